"""The command line and what it runs: generate, chat, serve, bench, train-drafter. Nothing below imports it."""
