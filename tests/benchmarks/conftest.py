"""The benchmark scripts' pieces under test are imported as the scripts import each other: benchmarks/ first on
sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
