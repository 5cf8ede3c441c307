"""Environments: what multi-turn episodes talk to (contract in `stages.environments.base`)."""
