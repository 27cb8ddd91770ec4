"""The machinery the phase scripts and launchers call: engines, rollout files, records, checkpoints, the hand-off,
nodes, processes, the preflight, tracking, the evaluation protocol, the grading pool. Run its commands as
`python -m mu_grpo.<module>` from the repository's root."""
