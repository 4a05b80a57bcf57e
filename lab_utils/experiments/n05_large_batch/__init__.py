"""Notebook 05: large-batch accuracy and what DDP communicates (Q5-Q7).
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Q4.1", "Large-batch accuracy after 5 epochs", "05_large_batch_training",
            "Reading the table and the figures",
            "Loss and test accuracy at epoch 5 with 512 per GPU on 4 GPUs against 128 on 1 GPU.",
            ("large_batch",), ("large_batch_accuracy_epoch", "large_batch_accuracy_time"),
            by_hand="q05_accuracy",
            by_hand_asks="After 5 epochs, how far is the large batch at lr 0.1 behind the reference (loss, "
                         "train and test accuracy), and how many optimizer steps did each take? Which "
                         "accuracy did the earlier cohort report, and which of your columns do you set it "
                         "beside? Quote the rows of your table."),
    Section("Q4.2", "Why the large batch falls behind, and how to improve it", "05_large_batch_training",
            "Why a large batch loses accuracy at a fixed learning rate and a fixed number of epochs",
            "Explain the gap (optimizer steps per epoch, learning rate per image, the noise of the "
            "gradient), then improve it: linear learning-rate scaling and warm-up (Goyal et al. 2017).",
            ("large_batch",), ("large_batch_lr",),
            report=("At equal wall-clock time, which configuration is ahead? Would you pay for 4 GPUs to "
                    "train this model, and with which learning-rate rule?",),
            by_hand="q05_report", exercises=("q05_lr_schedule", "q05_recipe"),
            by_hand_asks="Why does the large batch at lr 0.1 fall behind the reference (one sentence, with "
                         "the optimizer steps of each run)? Which remedy closed most of the gap? Did "
                         "linear scaling alone work, and what happened in its first epoch? Quote the rows "
                         "of your table."),
    Section("Q5", "Why the epoch must be set on the DistributedSampler (set_epoch)",
            "05_large_batch_training",
            "`set_epoch`: which images a rank sees in each epoch",
            "What goes wrong without set_epoch, and why does nothing crash?",
            report=("What goes wrong if `set_epoch` is not called, and why does nothing crash? Quote two "
                    "epochs' indices from the notebook's set_epoch table.",),
            exercises=("q05_set_epoch",)),
    Section("Q6", "Are gradients the only messages communicated across learners?", "05_large_batch_training",
            "Are gradients the only thing communicated?",
            "List what DDP communicates besides the gradients, with bytes per step for the spec "
            "ResNet-18.", ("comm_accounting", "comm_accounting_wire"),
            by_hand="q05_messages",
            by_hand_asks="List what DDP communicates besides the gradients, with the bytes per step for the "
                         "spec ResNet-18 (11,173,962 parameters); quote the rows of your ledger. ZeRO-1 two "
                         "ways: torch's ZeroRedundancyOptimizer (the ledger's ZeRO-1 rows) and the paper's "
                         "(Rajbhandari et al. 2020, sec. 7.2.1: reduce-scatter the gradients, step each "
                         "rank's shard, all-gather the parameters). How many bytes does one rank send per "
                         "step in each, against DDP, and why do they differ? What does each save?"),
    Section("Q7", "At 4 GPUs x 512 per GPU, is communicating only the gradients enough?",
            "05_large_batch_training", "At 4 GPUs x 512 per GPU: is communicating only the gradients enough?",
            "Answer from the communication ledger at 4 x 512: what keeps the replicas identical, what else "
            "must cross the network, and what large-batch training needs beyond the gradients.",
            ("comm_gradients_only",),
            by_hand="q05_gradients_only",
            by_hand_asks="At 4 GPUs x 512 per GPU, is communicating only the gradients enough? Answer from "
                         "the ledger: what keeps the weights identical, which other messages the run needs "
                         "and what breaks without each (initial broadcast, BatchNorm buffers, loss and "
                         "metric reductions), what the large-batch remedies (linear scaling, warm-up) need, "
                         "and what share of the epoch's bytes is not gradients."),
)
