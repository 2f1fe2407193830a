/* main.c — `deltafin` entry point: the command list and the dispatch to the
 * cmd_*.c files (the helpers they share live in opts.c). */
#include "cli.h"
#include <stdio.h>
#include <string.h>

static const char usage_text[] =
    "usage: deltafin COMMAND [options]\n"
    "\n"
    "models:\n"
    "  run            greedy ids from --tokens, or streamed text from --prompt (--chat, sampling)\n"
    "  chat           interactive conversation in the model's chat format (/reset, /stats)\n"
    "  logits         float32 logits for every position of a token sequence\n"
    "  inspect        architecture, experts, memory plan\n"
    "  eval           perplexity on a text; KL divergence and top-1 against a base run's logits\n"
    "  serve          OpenAI-compatible HTTP server\n"
    "hub:\n"
    "  setup          install a model from a Hugging Face-compatible hub (full or stream)\n"
    "  fetch-experts  complete a stream-mode mirror (all, or --layers)\n"
    "  warm           fetch the most-used missing experts of a mirror (--trace / --heat)\n"
    "  doctor         offline health check of a mirror made by setup\n"
    "  convert-spine  the spine's matrices to row-wise int8 beside the checkpoint (--spine-dtype int8)\n"
    "text:\n"
    "  tokenize       text -> token ids (tiktoken rank file, tokenizer.json, model dir)\n"
    "  detokenize     token ids -> text\n"
    "tools:\n"
    "  synth          write a random-weight checkpoint of a supported family\n"
    "  bench          --kernels, --decode, --tokenizer\n"
    "\n"
    "`deltafin COMMAND --help` shows a command's options.\n";

int main(int argc, char **argv) {
    if (argc < 2) { fputs(usage_text, stderr); return CLI_USAGE; }
    const char *c = argv[1];
    if (!strcmp(c, "--help") || !strcmp(c, "-h") || !strcmp(c, "help")) { fputs(usage_text, stdout); return 0; }
    if (!strcmp(c, "run")) return cmd_run_wants_text(argc - 1, argv + 1) ? cmd_run_text(argc - 1, argv + 1) : cmd_run(argc - 1, argv + 1);
    if (!strcmp(c, "logits")) return cmd_logits(argc - 1, argv + 1);
    if (!strcmp(c, "inspect")) return cmd_inspect(argc - 1, argv + 1);
    if (!strcmp(c, "bench") && cmd_bench_wants_tokenizer(argc - 1, argv + 1)) return cmd_bench_tokenizer(argc - 1, argv + 1);
    if (!strcmp(c, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(c, "synth")) return cmd_synth(argc - 1, argv + 1);
    if (!strcmp(c, "tokenize")) return cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(c, "detokenize")) return cmd_detokenize(argc - 1, argv + 1);
    if (!strcmp(c, "serve")) return cmd_serve(argc - 1, argv + 1);
    if (!strcmp(c, "setup")) return cmd_setup(argc - 1, argv + 1);
    if (!strcmp(c, "fetch-experts")) return cmd_fetch_experts(argc - 1, argv + 1);
    if (!strcmp(c, "doctor")) return cmd_doctor(argc - 1, argv + 1);
    if (!strcmp(c, "warm")) return cmd_warm(argc - 1, argv + 1);
    if (!strcmp(c, "chat")) return cmd_chat(argc - 1, argv + 1);
    if (!strcmp(c, "convert-spine")) return cmd_convert_spine(argc - 1, argv + 1);
    if (!strcmp(c, "eval")) return cmd_eval(argc - 1, argv + 1);
    fprintf(stderr, "deltafin: unknown command '%s'\n\n%s", c, usage_text);
    return CLI_USAGE;
}
