"""The kernel contract: records, gates, controls, runner, report."""
