"""Memory planning: what a job needs per device (`planner`), the `plan` report (`report`) and the
per-machine tables of the published files (`tables`)."""
