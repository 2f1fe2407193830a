/* fuzz_hub_listing.c — libFuzzer harness: what a hub answers to a listing
 * (src/hub/http.c): the model info (hub_parse_info), tree pages
 * (hub_parse_tree) and the Link header of a page (hub_link_next). The HTTP
 * exchange itself is libcurl's; this is the part that reads the answers.
 *
 * Input: a flags byte, then INFO FZ_SEP PAGE FZ_SEP PAGE ... (up to 6
 * parts); with flag bit 0 the last part is a Link header value instead of a
 * page, read into a buffer of 1, 8, 64 or 2048 bytes (bits 1-2). Checks:
 * accepted names are never absolute or "..", the tree adds no files and
 * gives only sizes >= 0 and whole hashes; a next link fits its buffer, is
 * non-empty, free of spaces and control bytes and a piece of the header.
 */
#include "common.h"
#include "../../src/hub/hub.h"
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_listing(const hub_listing *l) {
    for (int i = 0; i < l->n_files; i++) {
        const hub_file *f = &l->files[i];
        if (!f->path || !f->path[0] || f->path[0] == '/' || strstr(f->path, "..")) fz_die("accepted name '%s'", f->path);
        if (f->size < -1) fz_die("%s: size %lld", f->path, (long long)f->size);
        size_t s = strlen(f->sha256), g = strlen(f->git);
        if ((s && s != 64) || (g && g != 40)) fz_die("%s: a hash of %zu / %zu characters", f->path, s, g);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int flags = data[0];
    fz_part p[6];
    int np = fz_split(data + 1, size - 1, p, 6);
    int pages = np - 1;
    if ((flags & 1) && np > 1) {
        static const size_t caps[] = {1, 8, 64, 2048};
        size_t cap = caps[(flags >> 1) & 3];
        char out[2048];
        fz_part h = p[np - 1];
        pages--;
        int r = hub_link_next((const char *)h.p, h.n, out, cap);
        if (r == 1) {
            size_t on = strlen(out);
            if (!on || on >= cap || !memmem(h.p, h.n, out, on)) fz_die("next link '%s' (buffer %zu)", out, cap);
            for (size_t k = 0; k < on; k++)
                if ((unsigned char)out[k] <= ' ' || out[k] == 0x7f) fz_die("next link with byte 0x%02x", (unsigned char)out[k]);
        }
        if (r < -1 || r > 1) fz_die("hub_link_next returned %d", r);
    }
    hub_listing l;
    char err[DF_ERRMSG];
    df_status st = hub_parse_info((const char *)p[0].p, p[0].n, "listing", &l, err);
    if (st == DF_OK) {
        check_listing(&l);
        int n = l.n_files;
        for (int i = 0; i < pages; i++) {
            if (hub_parse_tree((const char *)p[1 + i].p, p[1 + i].n, "listing", &l, err) != DF_OK) {
                fz_note("%s", err);
                continue;
            }
            if (l.n_files != n) fz_die("a tree page added files");
            check_listing(&l);
        }
    } else {
        fz_note("%s", err);
    }
    hub_listing_free(&l);
    return 0;
}
