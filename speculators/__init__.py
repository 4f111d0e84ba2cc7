"""Built-in speculators, found through the `speckernel.speculators` entry points."""
