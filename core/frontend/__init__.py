"""The frontend: AsyncEngine in the caller's loop, its blocking facade, the client of the core process."""
