"""Recipes and inventory: YAML files validated with pydantic, errors with file:line."""
