"""Maps the repository's top-level folders onto the `spotguard.<part>` subpackages.

Everything else about the distribution is in pyproject.toml; this file exists only because
the folder -> package mapping must list nested packages, which pyproject cannot compute.

Which parts go in is a build setting, the environment variable SPOTGUARD_PARTS:
- `all` (the default: `make install`, the training image): every part;
- `product` (daemonset/Dockerfile, the agent/sidecar/supervisor/injector image): `spotguard`
  and the product parts only, without the test doubles and the dry-run (`emulator/`, `trainer/`)
  and without the framework integrations (`integrations/`).
Build a product wheel from a clean tree (no stale `build/` folder from a full build).
"""
import os

from setuptools import find_packages, setup

PRODUCT_PARTS = ("agent", "hooks", "supervisor", "injector")
TEST_AND_DRY_RUN_PARTS = ("trainer", "emulator")
FRAMEWORK_PARTS = ("integrations",)  # the Trainer / Accelerate / Lightning integrations (extras hf, lightning)
PART_SETS = {"all": PRODUCT_PARTS + FRAMEWORK_PARTS + TEST_AND_DRY_RUN_PARTS, "product": PRODUCT_PARTS}

parts_setting = os.environ.get("SPOTGUARD_PARTS", "").strip() or "all"
if parts_setting not in PART_SETS:
    raise SystemExit(f"SPOTGUARD_PARTS: expected one of {', '.join(PART_SETS)}, got {parts_setting!r}")
parts = PART_SETS[parts_setting]

package_dir = {"spotguard": "spotguard"}
packages = ["spotguard", *(f"spotguard.{p}" for p in find_packages("spotguard"))]
for part in parts:
    package_dir[f"spotguard.{part}"] = part
    packages.append(f"spotguard.{part}")
    packages += [f"spotguard.{part}.{sub}" for sub in find_packages(part)]
# The dry-run's bundled scenarios and spot traces: data folders, listed as packages of their own
# so setuptools knows they are meant to be installed (it warns about importable folders it is not told of).
TRAINER_DATA = {"spotguard.trainer.scenarios": ["*.yaml"], "spotguard.trainer.traces": ["*.csv", "README.md"]}
package_data = {}
if "trainer" in parts:
    package_data = TRAINER_DATA
    packages += list(TRAINER_DATA)

setup(packages=packages, package_dir=package_dir, package_data=package_data)
