"""A drafter rigged from a known continuation, shared by the lossless and the replay tests."""

import torch


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
        logits = torch.zeros(depth, self.vocab)
        for d in range(1, depth + 1):
            p = start + d
            true = self.reference[p] if p < len(self.reference) else 0
            decoy = (true + 1 + p) % self.vocab
            if p % 7 == 3:
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
