"""qflax's engine (internal): interception, op registry, provenance, dispatch, layouts.

Nothing here is public API: the public names are re-exported from :mod:`qflax`.
See ``docs/extending.md`` for how the parts fit together.
"""
