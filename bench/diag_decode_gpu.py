"""Where does bf16 one-token decode drift? For a synth model and a random prompt, compare at each
decode step: HF decode vs HF prefill of the same sequence, kiln decode vs kiln prefill, kiln
decode vs HF decode. Prints one line per step; JSON to argv[3]. (Diagnostic for the decode issue.)"""

import json
import sys

import torch

import kiln
from kiln.reference_hf import load_hf_reference
from kiln.synth import random_prompt

spec, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
steps = 14
ref = load_hf_reference(spec, "bf16", "cuda")
prompt = random_prompt(n, ref.config.vocab_size, 0)
with torch.no_grad():
    g = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps, do_sample=False,
                     output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    seq = g.sequences[0].tolist()
    hf_dec = [x[0].float() for x in g.logits]
    hf_pre = ref(torch.tensor([seq[:-1]], device="cuda")).logits[0, n - 1:].float()
del ref
torch.cuda.empty_cache()
llm = kiln.load(spec, device="cuda", dtype="bf16")
m = llm.model
with torch.no_grad():
    st = m.make_state(torch.bfloat16, torch.device("cuda"))
    kd = [m.forward(torch.tensor(prompt, device="cuda"), torch.arange(n, device="cuda"), st)[-1].float()]
    for i, t in enumerate(seq[n:-1]):
        kd.append(m.forward(torch.tensor([t], device="cuda"), torch.tensor([n + i], device="cuda"), st)[-1].float())
    st = m.make_state(torch.bfloat16, torch.device("cuda"))
    kp = m.forward(torch.tensor(seq[:-1], device="cuda"), torch.arange(len(seq) - 1, device="cuda"), st,
                   last_only=False)[n - 1:].float()
rows = []
for i in range(steps):
    d = lambda a, b: float((a - b).abs().max())  # noqa: E731
    rows.append({"step": i, "hf_dec_vs_hf_pre": d(hf_dec[i], hf_pre[i]), "kiln_dec_vs_kiln_pre": d(kd[i], kp[i]),
                 "kiln_dec_vs_hf_dec": d(kd[i], hf_dec[i]), "kiln_pre_vs_hf_pre": d(kp[i], hf_pre[i]),
                 "hf_argmax": int(hf_dec[i].argmax()), "kiln_argmax": int(kd[i].argmax())})
    print(rows[-1], flush=True)
json.dump({"spec": spec, "prompt_tokens": n, "rows": rows}, open(out, "w"), indent=1)
