"""The machine a plan is priced on: cluster descriptions (presets and measured) and measuring one."""
