"""reasoning-gym task mixtures: deterministic items with questions and reference answers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskItem:
    task: str
    question: str
    answer: str
    index: int  # position within its task's generated dataset


def mixture_counts(tasks: tuple[tuple[str, float], ...], total: int) -> list[int]:
    """Items per task, proportional to the weights, summing to ``total`` (largest remainder)."""
    weight_sum = sum(w for _, w in tasks)
    exact = [total * w / weight_sum for _, w in tasks]
    counts = [int(x) for x in exact]
    order = sorted(range(len(tasks)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def generate_items(tasks: tuple[tuple[str, float], ...], total: int, seed: int) -> list[TaskItem]:
    """``total`` items of the mixture, task by task, each task seeded from ``seed``."""
    import reasoning_gym

    items: list[TaskItem] = []
    for (name, _), count in zip(tasks, mixture_counts(tasks, total)):
        if count == 0:
            continue
        dataset = reasoning_gym.create_dataset(name, size=count, seed=seed)
        for i, entry in enumerate(dataset):
            items.append(TaskItem(name, str(entry["question"]), str(entry["answer"]), i))
    return items
