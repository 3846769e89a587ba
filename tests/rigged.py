"""A drafter rigged from a known continuation, shared by the lossless and the replay tests, and the reference they
are held to."""

import torch


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of `prompt`: the reference for losslessness, independent of ddtree's loop (its
    `ar` method shares the prefill, verify, walk and cache compaction with every other method)."""
    ids = torch.tensor([prompt], device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


class RiggedDrafter:
    """Knows the reference continuation and drafts it in a chosen pattern.

    At position p (depth d after the root at `start`, p = start + d):
      p % 5 == 0 -> the true token is the 2nd choice behind a decoy (a non-first branch);
      p % 7 == 3 -> the true token is missing (the walk must stop there);
      otherwise  -> the true token is the confident first choice.
    """

    def __init__(self, reference: list[int], vocab: int, block_size: int = 16):
        self.reference, self.vocab, self.block_size = reference, vocab, block_size
        self.calls = []  # (start, depth) of each propose

    def reset(self):
        pass

    def features(self, hidden_states):
        return hidden_states[-1][:, :, :1]  # unused by this drafter

    def propose(self, root_token, start, new_context, depth):
        self.calls.append((start, depth))
        return self.rows(start, depth)

    def rows(self, start, depth, miss_from=None):
        """The rigged logits (depth, V) of depths 1..depth after the root at `start`; from depth `miss_from` on,
        every true token is missing, as at the positions p % 7 == 3."""
        logits = torch.zeros(depth, self.vocab)
        for d in range(1, depth + 1):
            p = start + d
            true = self.reference[p] if p < len(self.reference) else 0
            decoy = (true + 1 + p) % self.vocab
            if p % 7 == 3 or (miss_from is not None and d >= miss_from):
                logits[d - 1, decoy] = 12.0
                logits[d - 1, (decoy + 1) % self.vocab] = 11.0
                logits[d - 1, true] = -10.0
            elif p % 5 == 0:
                logits[d - 1, decoy] = 14.0
                logits[d - 1, true] = 13.5
            else:
                logits[d - 1, true] = 16.0
        return logits

    def non_first_branch_accepted(self, start, accepted_depth):
        return any((start + d) % 5 == 0 and (start + d) % 7 != 3 for d in range(1, accepted_depth + 1))


class RedraftRigged(RiggedDrafter):
    """Drafts depth 1 as RiggedDrafter but misses every deeper token; re-drafted behind the true depth-1 token, it
    drafts the rest as RiggedDrafter, behind any other token it misses again. Long paths need the re-draft."""

    def __init__(self, reference: list[int], vocab: int, block_size: int = 16):
        super().__init__(reference, vocab, block_size)
        self.redrafts = []  # (start, firsts) of each redraft

    def missing(self, start, depth):  # (depth - 1, V) rows of depths 2..depth where no true token is drafted
        return self.rows(start, depth, miss_from=2)[1:]

    def propose(self, root_token, start, new_context, depth):
        self.calls.append((start, depth))
        return self.rows(start, depth, miss_from=2)

    def redraft(self, root_token, start, firsts, depth):
        self.redrafts.append((start, list(firsts)))
        true = self.reference[start + 1] if start + 1 < len(self.reference) else 0
        return torch.stack([self.rows(start, depth)[1:] if first == true else self.missing(start, depth) for first in firsts])
