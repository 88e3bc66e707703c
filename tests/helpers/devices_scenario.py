"""Train LoRA's ``devices`` input inside a process that boots real ComfyUI (see tests/comfy/test_distributed_workflow.py);
prints one JSON line of results.

    python devices_scenario.py COMFYUI_PATH WORKDIR

The example workflow (encode a folder, train a LoRA) through the executor, once with batch size 2 on one device
and once with batch size 1 on two (this process and a worker process, gloo on the CPU), then queued again
unchanged. On a ComfyUI whose loaders do not record their files, devices > 1 is refused with the reason.
"""

from __future__ import annotations

import os

from comfy_scenario import ENCODE, TRAIN, find, load_example, run_scenario_main, saved_lora, set_train, ui_text
from demo_assets import CKPT, write_dataset
from values import lora_difference

import headless  # scripts/, on PYTHONPATH (tests/helpers/installs.py: subprocess_env)

TRAIN_SETTINGS = dict(steps=4, rank=4, learning_rate=1e-3, training_dtype="fp32", lora_dtype="fp32", seed=5)


def train(server: headless._Server, name: str, batch_size: int, devices: int) -> dict:
    prompt = load_example("encode_and_train")
    prompt[find(prompt, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = CKPT
    prompt[find(prompt, ENCODE)]["inputs"].update(folder="dataset", resolution=64, batch_size=2)
    nid = find(prompt, TRAIN)
    set_train(prompt, nid, lora_name=name, batch_size=batch_size, **TRAIN_SETTINGS)
    prompt[nid]["inputs"]["devices"] = devices
    ok, result, error = headless.run(prompt, server)
    return {"ok": ok, "error": error, "text": ui_text(result, nid)}


def scenario(server: headless._Server) -> dict:
    import folder_paths

    write_dataset(os.path.join(folder_paths.get_input_directory(), "dataset"))
    out: dict = {"one": train(server, "one", 2, 1), "two": train(server, "two", 1, 2)}
    if out["one"]["ok"] and out["two"]["ok"]:
        out["lora"] = lora_difference(saved_lora("one")["tensors"], saved_lora("two")["tensors"])
        out["again"] = train(server, "two", 1, 2)
        out["loras"] = sorted(n for n in os.listdir(folder_paths.get_folder_paths("loras")[0]) if "two" in n)
    return out


if __name__ == "__main__":
    run_scenario_main(scenario)
