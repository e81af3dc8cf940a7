"""The kernels' run-time choice of SIMD body (include/rl_isa.h: one probe for
all), behind each kernel module's ``isa()`` and ``_set_isa()``."""

NAMES = {1: "sse2", 2: "avx2", 3: "avx512"}
LEVELS = {name: level for level, name in NAMES.items()}


class Dispatch:
    """One kernel's choice: `select(want)` (its C dispatch: 0 the best the CPU
    has, a level above it falls back) sets the body and returns the level used."""

    def __init__(self, select):
        self._select = select
        self.level = select(0)

    def name(self):
        return NAMES[self.level]

    def force(self, name=None):
        """Use the body `name` (None: the best); returns the name in use."""
        self.level = self._select(0 if name is None else LEVELS[name])
        return NAMES[self.level]
