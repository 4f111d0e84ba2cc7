"""The model runner: runs a StepFrame on the device (forward, sampling, verification, the drafter's pass)."""
