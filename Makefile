# The two entry points of the README: `make demo` and `make test`.
# Both create the virtualenv and install what is needed on a fresh Debian machine.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: bytecode demo test test-loaded pytest-some test-kernel lint typecheck pytest bench setup clean stress

setup: $(STAMP)

# The editable install's compat mode: a .pth line puts the checkout on sys.path, where the
# default mode's import hook costs every start of python ~17 ms (docs/decisions.md, "Start-up").
$(STAMP): pyproject.toml scripts/ensure-system-deps
	sh scripts/ensure-system-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,bench]' --config-settings editable_mode=compat
	rm -f $(VENV)/.installed-*
	touch $@

# The package's bytecode, as `pip install` compiles it at install time: an environment with
# PYTHONDONTWRITEBYTECODE set (these machines' is) would compile ~90 modules at every start
# of `kprobes`, ~150 ms each time, and the tests start it hundreds of times. Only what
# changed is compiled again.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q kprobes

demo: bytecode
	$(BIN)/python samples/kprobe_example.py

lint: $(STAMP)
	$(BIN)/ruff check kprobes tests bench samples
	$(BIN)/ruff format --check kprobes

typecheck: $(STAMP)
	$(BIN)/mypy --strict kprobes

pytest: bytecode
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

# `pytest` runs tests/vm too: it boots Debian's stock kernel under qemu (software emulation)
# and runs the kernel tests inside it. `test-kernel` runs only those.
test: lint typecheck pytest

# `test` with a busy loop on every CPU beside it (scripts/cpu-burner), stopped when it ends
# whatever the result: a test that assumes the machine's speed fails here first.
# TESTS=... narrows it to some test files (the default is `test`'s whole suite).
test-loaded: bytecode
	sh scripts/cpu-burner $(MAKE) --no-print-directory $(if $(TESTS),lint typecheck pytest-some,test)

pytest-some: bytecode
	$(BIN)/python -m pytest -q -p no:cacheprovider $(TESTS)

test-kernel: bytecode
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/vm

# The command line's stress test, long form: every command ended every way (SIGKILL too)
# against result-checking programs under load (tests/stress_commands.py). The suite runs
# it for a minute (tests/test_stress_commands.py). STRESS_SECONDS=N to change the length.
STRESS_SECONDS ?= 600
stress: bytecode
	$(BIN)/python tests/stress_commands.py --seconds $(STRESS_SECONDS)

bench: bytecode
	$(BIN)/python -m bench
	$(BIN)/python -m bench.registration
	$(BIN)/python -m bench.record_rate
	$(BIN)/python -m bench.decode
	$(BIN)/python -m bench.decode --vm

clean:
	rm -rf $(VENV) tests/programs/bin bench/bin
