"""The engine core: the step loop that joins kernel and runner, and the process that hosts it."""
