"""Placeholder until the guards package lands (replaced below)."""


def build_guard_sets(tenants):
    return {}


async def guard_input(ctx, spec, record):
    return None
