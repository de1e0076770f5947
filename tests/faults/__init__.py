"""Helper scripts that the fault-injection tests run as real processes."""
