# Two entry points; each bootstraps the environment first (see scripts/bootstrap.sh).
.PHONY: train test

train:
	@PY=$$(scripts/bootstrap.sh) && NGPU=$${NGPU:-} PYTHON=$$PY ./run_train.sh $(ARGS)

test:
	@PY=$$(scripts/bootstrap.sh) && $$PY -m pytest -q tests $(PYTEST_ARGS)
