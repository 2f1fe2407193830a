/* text.h — internals shared by the src/text files (prefix tok_).
 *
 * The public API is the text section of include/deltafin.h; this header only
 * carries the UTF-8 helpers that the tokenizer, the streaming decoder and the
 * chat parser share.
 */
#ifndef DF_TEXT_H
#define DF_TEXT_H
#include "deltafin.h"
#include <stddef.h>
#include <stdint.h>

/* One step of UTF-8 decoding at p[0..n) (n >= 1).
 *   > 0: a valid sequence of that many bytes; *cp receives the code point.
 *   0:   p[0..n) is a valid but unfinished prefix (more bytes may complete it).
 *   < 0: -k, the first k bytes are a maximal invalid subpart (one U+FFFD,
 *        as WHATWG TextDecoder and Python's "replace" do). */
int tok_utf8_step(const unsigned char *p, size_t n, uint32_t *cp);
/* Offset of the first invalid byte of s[0..n), or n if s is valid UTF-8
 * (an unfinished sequence at the end counts as invalid). */
size_t tok_utf8_check(const char *s, size_t n);
/* Appends the UTF-8 encoding of cp (<= 0x10FFFF) to out; returns its length. */
int tok_utf8_put(uint32_t cp, char *out);

/* The pre-tokenisation pieces of text (special spellings under
 * DF_TOK_SPECIAL, then slices and regex pieces), in order, as cb calls;
 * for tests and debugging. */
df_status tok_pieces(const df_tokenizer *t, const char *text, size_t len, unsigned flags,
                     void (*cb)(void *ud, const char *piece, size_t n), void *ud, char err[DF_ERRMSG]);

#endif
