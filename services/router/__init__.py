"""Router tier: worker choice, dynamic batching windows, health, zone failover, resume."""
