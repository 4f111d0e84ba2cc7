"""Built-in platforms: cpu, cuda, ascend. Found through the `speckernel.platforms` entry points."""
