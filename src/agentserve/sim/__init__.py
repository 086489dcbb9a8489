"""The discrete-event simulator: a simulated clock and a cost-model Executor, so the
engine's scheduler and KV manager run unchanged in simulation; its driver and reports.
No torch."""
