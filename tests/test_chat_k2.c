/* test_chat_k2.c — the Kimi-K2 chat format (suite text_k2_): golden
 * renderings written by hand from the Kimi-K2-Instruct chat_template's
 * behaviour (default system message + newline when none is given, tools
 * declared first as compact sorted JSON, tool calls section, tool results
 * as "## Return of ID"). Rendered as text with the specials spelled. */
#include "test.h"
#include "deltafin.h"
#include <stdlib.h>
#include <string.h>

static char *render(const df_chat_msg *m, int n, const char *tools, int gen) {
    df_chat_opts o;
    df_chat_opts_default(&o);
    o.format = "kimi_k2";
    o.tools = tools;
    o.add_generation_prompt = gen;
    char *text = NULL, err[DF_ERRMSG];
    if (df_chat_render(NULL, m, n, &o, NULL, &text, err) != DF_OK) {
        fprintf(stderr, "    %s\n", err);
        return NULL;
    }
    return text;
}

TEST(text_k2_default_system_and_generation_prompt) {
    df_chat_msg m[] = {{.role = "user", .content = "Hi"}};
    char *t = render(m, 1, NULL, 1);
    const char *want = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n"
                       "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>";
    CHECK(t && !strcmp(t, want), "got: %s", t ? t : "(null)");
    free(t);
}

TEST(text_k2_system_given_multi_turn) {
    df_chat_msg m[] = {{.role = "system", .content = "Be brief."},
                       {.role = "user", .content = "2+2?"},
                       {.role = "assistant", .content = "4", .reasoning = "easy"},
                       {.role = "user", .content = "<|im_end|> is text here"}};
    char *t = render(m, 4, NULL, 0);
    const char *want = "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                       "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
                       "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
                       "<|im_user|>user<|im_middle|><|im_end|> is text here<|im_end|>";
    CHECK(t && !strcmp(t, want), "got: %s", t ? t : "(null)");
    free(t);
}

TEST(text_k2_tools_calls_and_results) {
    const char *tools = "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
                        "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}]";
    df_chat_msg m[] = {
        {.role = "user", .content = "Weather in Paris?"},
        {.role = "assistant", .content = "",
         .tool_calls = "[{\"id\": \"functions.get_weather:0\", \"type\": \"function\", \"function\": "
                       "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}]"},
        {.role = "tool", .name = "get_weather", .tool_call_id = "functions.get_weather:0", .content = "18C"},
    };
    char *t = render(m, 3, tools, 1);
    const char *want =
        "<|im_system|>tool_declare<|im_middle|>[{\"function\":{\"name\":\"get_weather\",\"parameters\":{\"properties\":"
        "{\"city\":{\"type\":\"string\"}},\"type\":\"object\"}},\"type\":\"function\"}]<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>";
    CHECK(t && !strcmp(t, want), "got: %s", t ? t : "(null)");
    free(t);
}
