"""The Llama-family target model, its loaders and the embedded default model."""
