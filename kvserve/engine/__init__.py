"""The engine core: one request type in, one step of schedule -> extend -> execute ->
update -> observe, typed stats out. See docs/architecture.md (the first screen)."""
