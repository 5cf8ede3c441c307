"""The config's sections, one module per kind of section, each section with the factory of what it
describes (`make(ctx)`); `baton.schema.RunConfig` composes them (baton/sections/base.py says how)."""
