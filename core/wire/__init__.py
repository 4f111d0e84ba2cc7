"""The wire between frontend and core: msgspec messages and their zero-copy codec."""
