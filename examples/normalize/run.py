"""Normalise int16 features with the compiled map and check it against NumPy.

    cd examples/normalize && python setup.py build_ext --inplace && python run.py
"""
from typing import Any

import numpy as np
import numpy.typing as npt

import readerlib as rl
from normalize import Normalize, normalize_numpy

D = 80


def make_reader(n: int, seed: int = 0) -> rl.ArrayReader:
    rng = np.random.default_rng(seed)
    feats = [rng.integers(-32768, 32768, size=(int(t), D), dtype=np.int16)
             for t in rng.integers(50, 300, size=n)]
    schema = rl.Schema([rl.Field("feats", np.int16, (D,), lod_level=1), rl.Field("label", np.int64)])
    return rl.ArrayReader({"feats": feats, "label": np.arange(n, dtype=np.int64)}, schema=schema)


def main() -> None:
    mean: npt.NDArray[np.float32] = np.linspace(-10, 10, D, dtype=np.float32)
    std: npt.NDArray[np.float32] = np.linspace(50, 500, D, dtype=np.float32)
    compiled = make_reader(200).map(Normalize("feats", mean, std)).batch(32)
    names = compiled.schema.names

    def reference(x: tuple[Any, ...]) -> tuple[Any, ...]:
        return normalize_numpy(x, names, "feats", mean, std)

    python = make_reader(200).map(reference).batch(32)
    n = 0
    for a, b in zip(compiled, python):
        feats_a: rl.LoDTensor = a[0]
        feats_b: rl.LoDTensor = b[0]
        assert feats_a.dtype == np.float32
        assert np.array_equal(feats_a.data, feats_b.data)
        n += len(feats_a)
    print(f"{n} instances: the compiled map equals the NumPy map")


if __name__ == "__main__":
    main()
