# Two entry points for a fresh machine (README): `make demo` and `make test`.
# Both create .venv when missing and install dsclip with `pip install -e .[dev,hf]`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine's pip serves these torch/torchvision builds from local disk; override on other hosts.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# Private, persistent JIT cache for DeepSpeed's CPU ops (see DEEPSPEED-NOTES: ninja rebuilds otherwise).
# Per checkout (= per venv): two ninja binaries alternating on one cache rebuild the op every time.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per core of a 2-core CI machine. The gloo tests start their
# own rank processes, so more workers than cores only adds contention. loadgroup keeps the launch tests
# (xdist_group "launch", tests/conftest.py) on one worker, one after another.
PYTEST_WORKERS ?= 2
# The fast numerical suites that .ci/run repeats under every CPU kernel family and 1 / 2 threads
# (`make test-kernels`): tolerances that hold only for one kernel's summation order fail here. The two
# gradient-cache cases (ids k-stage-world) are the ones that failed on CI's AVX2 machines before; they
# come first so the two xdist workers start on the two long ones together. -k leaves out the tests of
# these files that compute no float result (an import check in a subprocess, parameter counts on meta).
KERNEL_TESTS ?= 'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch[1-3-2]' \
	'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch[2-3-1]' \
	tests/unit/test_losses.py tests/unit/test_openclip_interop.py \
	-k 'not test_losses_never_import_deepspeed and not test_param_count_matches_openclip_on_meta'
# .ci/run passes --after-make-test: the leg with this CPU's best kernels and 1 thread is `make test` itself.
KERNEL_LEGS_ARGS ?=

.PHONY: venv demo test test-all test-kernels test-ds-floor lint docs clean

# DeepSpeed JIT-compiles two C++ ops on CPU the first time they are used: the shm all-reduce (every run)
# and cpu_adam (ZeRO-Offload); ~1-2 min of both cores from nothing. `make venv` compiles them into
# TORCH_EXTENSIONS_DIR in the background while pip installs the dev extras (pip is one process, mostly
# downloading and unpacking), so that time overlaps instead of landing on the first test that needs each
# op. The venv's bin leads PATH so the venv's ninja builds them, as in the tests (tests/conftest.py).
BUILD_OPS := from deepspeed.accelerator import get_accelerator as a; [a().create_op_builder(n).load() for n in ("ShareMemCommBuilder", "CPUAdamBuilder")]

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e .
	PATH="$(abspath $(VENV))/bin:$$PATH" OMP_NUM_THREADS=1 $(PY) -c '$(BUILD_OPS)' >$(VENV)/ops-build.log 2>&1 & ops=$$!; \
	  $(PY) -m pip install -q -e '.[dev,hf]'; pip_rc=$$?; \
	  wait $$ops || { tail -n 30 $(VENV)/ops-build.log; echo "building DeepSpeed's CPU ops failed: $(VENV)/ops-build.log"; exit 1; }; \
	  exit $$pip_rc
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m dsclip train --config dsclip/recipes/demo.yaml --logs runs --name demo --overwrite $(ARGS)

test: venv
	$(PY) -m ruff check dsclip tests bench
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# The user guide as a site (docs/, mkdocs.yml): the CLI reference regenerated from the parsers, then a
# strict build (a broken link or a page missing from the nav fails). .ci/run runs it after `make test`.
docs: venv
	$(PY) docs/gen_cli_reference.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# Also the scale smoke tests (ViT-H-14 / ViT-bigG-14 under ZeRO-3 on 2 CPU ranks, ~10 min, ~15 GB RAM).
test-all: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

# KERNEL_TESTS under ATEN_CPU_CAPABILITY=default, avx2 and (where the CPU has it) avx512, each with 1 and 2
# threads per process; every leg prints the capability torch really used (tests/conftest.py summary).
test-kernels: venv
	$(PY) tests/kernel_legs.py $(KERNEL_LEGS_ARGS) $(KERNEL_TESTS)

# The oldest DeepSpeed setup.py allows (the newest is the venv's own): the numerical core again against it
# (issue #31). A second venv holding only that DeepSpeed, its scripts and ninja, with the main venv's
# site-packages behind it (a .pth line), so nothing else is installed twice (seconds, not minutes). Its own
# JIT cache: the ops of two DeepSpeed releases differ. Tests that assert a patch is active ask the patch's
# check first (on this release most patches fall back: DeepSpeed's own paths are what is tested here).
# Left out to keep CI's time (measured 413 -> ~170 s on a 2-core machine): ZeRO-Offload, whose first use builds
# cpu_adam into this JIT cache (~2 min of both cores), and the ZeRO-3 world-size resume (150 s); the ZeRO-2 one
# still runs the universal conversion of this release.
DS_FLOOR ?= 0.19.2
FLOOR_VENV ?= .venv-ds-$(DS_FLOOR)
FLOOR_TESTS ?= tests/unit/test_patches.py tests/unit/test_overflow_check.py \
	'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch[2-2-1]' \
	'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch[2-2-2]' \
	'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch[2-3-1]' \
	'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch[2-3-2]' \
	'tests/dist/test_gradcache.py::test_gradcache_equals_big_batch_zero3_with_weights_partitioned[2]' \
	'tests/dist/test_gradcache.py::test_gradcache_other_zero_stages_and_offload[0]' \
	'tests/dist/test_gradcache.py::test_gradcache_other_zero_stages_and_offload[1]' \
	tests/dist/test_gradcache.py::test_gradcache_equals_big_batch_with_patches_off \
	tests/dist/test_gradcache.py::test_accum_freq_refused_where_deepspeed_lacks_coalesced_reduction \
	tests/dist/test_local_flush.py tests/dist/test_convert.py tests/dist/test_zero3_release.py \
	'tests/e2e/test_checkpoint_resume.py::test_resume_on_other_world_size_continues_loss_curve[2]' \
	'tests/e2e/test_train_cli.py::test_two_rank_deepspeed_launcher_trains_and_resumes_exactly[zero2_bf16]'

$(FLOOR_VENV)/.installed: $(VENV)/.installed
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps deepspeed==$(DS_FLOOR)
	ln -sf $(abspath $(VENV))/bin/ninja $(FLOOR_VENV)/bin/ninja
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	  > "$$($(FLOOR_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_main_venv.pth"
	$(FLOOR_VENV)/bin/python -c 'import deepspeed, dsclip; assert deepspeed.__version__ == "$(DS_FLOOR)", deepspeed.__version__'
	touch $@

test-ds-floor: $(FLOOR_VENV)/.installed
	TORCH_EXTENSIONS_DIR=$(CURDIR)/.cache/torch_extensions-ds-$(DS_FLOOR) OMP_NUM_THREADS=1 $(FLOOR_VENV)/bin/python \
	  -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=10 $(FLOOR_TESTS)

lint: venv
	$(PY) -m ruff check dsclip tests bench
	$(PY) -m ruff format --check dsclip tests bench

clean:
	rm -rf runs site .pytest_cache .ruff_cache
