"""`speckernel train-drafter`: the target's own answers, then a learned drafter trained on them."""
