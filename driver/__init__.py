"""The driver of a run: what the flow's tasks wire together and step. ``session`` holds the live
pools of one training segment, ``rollouts`` how each mode drives the rollout workers,
``environment`` the configured environment and the checks of a run against it, and
``step_log``, ``tracking``, ``health`` and ``plots`` what a step logs and draws."""
