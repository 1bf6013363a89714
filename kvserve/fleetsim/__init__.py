"""The fleet simulator (``kvserve simulate``): a discrete-event simulation of dozens of models
on simulated GPUs, driven by kvserve's own router, autoscaling policies, residency tiers and
scheduler, with step times from the planner's roofline (docs/fleet_simulator.md)."""
