"""Build a recipe's offline feature store: `make features RECIPE=x` (the store itself: training/feature_store.py).

    make features RECIPE=smollm2-135m                         # = python -m training.features --recipe smollm2-135m
    python -m training.features --recipe tiny --out /data/features/tiny [--force] [--dtype auto|bfloat16|float32]
    python -m training.train --recipe smollm2-135m --data.feature_store <the folder it printed>

Recipe fields can be overridden as for training (--model.target_layer_ids '[1, 3]', ...). The store
folder defaults to the recipe's data.feature_store, else <ddtree cache>/features/<recipe>-<tokenization key>
(with -final appended when the recipe distils, model.distill_weight > 0: that store also holds the target's
final hidden states; -top<k> instead with model.distill_top_k k: the target's k likeliest next tokens).
Bad input prints one line and exits with status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .arguments import answer_early, check_recipe_args, check_recipe_name, features_parser, recipe_path

# python -m: --help and a bad --recipe before torch loads
answer_early(__name__, features_parser, check_recipe_args, overrides=True)

from ddtree.errors import DDTreeError, command
from ddtree.targets import DTYPES, parse_dtype

from .data import DistillDataModule
from .feature_store import (AUTO_STORE, build_feature_store, default_store_path, drafter_layer_ids, resolve_store_path,
                            store_seconds, store_teacher)
from .module import check_store_fields
from .recipe import read_recipe
from .recipe_data import prepare_recipe_data
from .target import dtype_for_precision


@command
def main(argv: list[str] | None = None) -> int:
    parser = features_parser()
    args, overrides = parser.parse_known_args(argv)  # the rest overrides recipe fields, as in training.train
    try:
        dtype = parse_dtype(args.dtype, "--dtype") if args.dtype != "auto" else None
    except DDTreeError:  # the same refusal, naming auto too: the default, and the value that follows the recipe
        raise DDTreeError(f"--dtype={args.dtype!r}: choose auto or one of {', '.join(DTYPES)}") from None
    check_recipe_name(args.recipe)
    config = read_recipe(recipe_path(args.recipe), overrides)
    # as training checks them: a store for values it refuses took minutes to hours to build
    check_store_fields(config.model.target_layer_ids, config.model.distill_weight, config.model.distill_loss,
                       config.model.distill_top_k)
    if dtype is None:  # the same rule as training: a store in another dtype than training's would be cast every step
        dtype = dtype_for_precision(config.trainer.precision, config.model.target_dtype)
    datamodule = DistillDataModule(**config.data.as_dict())
    prepare_recipe_data(datamodule, args.recipe, target_adapter=config.model.target_adapter)
    # distillation reads the target's final hidden states, or its top k, too
    final_hidden, teacher_top_k = store_teacher(config.model.distill_weight, config.model.distill_top_k)
    features = dict(layer_ids=drafter_layer_ids(config.model.target_layer_ids, config.model.init_from),
                    target_adapter=config.model.target_adapter, dtype=dtype)  # what the store's features are
    own = default_store_path(args.recipe, datamodule, final_hidden, teacher_top_k)
    out = Path(args.out or resolve_store_path(datamodule.feature_store, args.recipe, datamodule, final_hidden,
                                              teacher_top_k, **features) or own)
    if args.out is None and datamodule.feature_store == AUTO_STORE and out != own:
        # A richer store of the recipe (final hidden states, a teacher) that training reads for this build too: it is
        # never the place to build this one, which --force would have replaced it with.
        if not args.force:
            print(f"[features] {out} already holds these features (and more), and training reads it: nothing to do; "
                  f"--force builds this store on its own at {own}", flush=True)
            return 0
        out = own
    print(f"[features] recipe {args.recipe} -> {out}", flush=True)
    build_feature_store(datamodule, out, **features, force=args.force, final_hidden=final_hidden,
                        teacher_top_k=teacher_top_k, max_seconds=store_seconds(datamodule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
