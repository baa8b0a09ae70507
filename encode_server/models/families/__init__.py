"""One module per encoder family, named after the family; each ends with `FAMILY = Family(...)`.

A family module builds its adapter (from a shared tower in `towers/` where one fits), loads it from a
checkpoint folder (`loading/`), declares its built-in tiny models and its tensor-parallel plan, and is
listed in `registry.FAMILY_MODULES`.
"""
