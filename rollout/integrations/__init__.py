"""Our scheduler in the engines RL stacks build where they offer no engine-argument passthrough (TRL)."""
