"""gRPC plumbing shared by every tier: server factory, errors, settings, logging, channels."""
