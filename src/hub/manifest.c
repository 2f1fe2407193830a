/* manifest.c — a mirror's manifest and the file helpers of the mirror's
 * files (see mirror.h).
 *
 * Owns: DIR/.deltafin-hub/manifest.json: endpoint, repo, revision, commit,
 * mode, whether setup finished, the cache limit, the last measured rate and
 * every file (path, size, sha256 / git blob id, verified); written to a
 * temporary file, fsync'd and renamed, so a crash leaves the old one or the
 * new one. Which repository files are shards and which are never fetched.
 * Refuses: a manifest without 'files' or 'mode', a file entry whose path
 * climbs out of the directory ("..", absolute).
 *
 * Sections: 1. names and files  2. the manifest
 */
#include "mirror.h"
#include "../base/err.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- 1. names and files -------------------------------------------------------------- */

int hub_is_shard(const char *p) {
    size_t n = strlen(p);
    return n > 12 && !strcmp(p + n - 12, ".safetensors");
}

/* Files deltafin never reads (other weight formats). */
int hub_skipped_file(const char *p) {
    static const char *const ext[] = {".bin", ".pth", ".pt", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt", ".ot"};
    size_t n = strlen(p);
    for (size_t i = 0; i < sizeof ext / sizeof ext[0]; i++) {
        size_t k = strlen(ext[i]);
        if (n > k && !strcmp(p + n - k, ext[i])) return 1;
    }
    return 0;
}

char *hub_pjoin(const char *a, const char *b) {
    size_t x = strlen(a), y = strlen(b);
    char *p = malloc(x + y + 2);
    if (!p) return NULL;
    memcpy(p, a, x);
    p[x] = '/';
    memcpy(p + x + 1, b, y + 1);
    return p;
}

const char *hub_mode_name(hub_mode m) { return m == HUB_STREAM ? "stream" : m == HUB_FULL ? "full" : "auto"; }

int hub_mkdirs(const char *path) {
    char *p = strdup(path);
    if (!p) return -1;
    for (char *q = p + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) { free(p); return -1; }
        *q = '/';
    }
    int rc = mkdir(p, 0755) != 0 && errno != EEXIST ? -1 : 0;
    free(p);
    return rc;
}

int hub_write_at(int fd, const void *p, size_t n, int64_t off) {
    const uint8_t *q = p;
    while (n) {
        ssize_t w = pwrite(fd, q, n, off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        q += w; n -= (size_t)w; off += w;
    }
    return 0;
}

/* ---- 2. the manifest ----------------------------------------------------------------- */

void hub_manifest_free(hub_manifest *m) {
    free(m->endpoint); free(m->repo); free(m->revision); free(m->commit);
    for (int i = 0; i < m->n_files; i++) free(m->files[i].path);
    free(m->files);
    free(m->verified);
    memset(m, 0, sizeof *m);
}

df_status hub_manifest_save(const char *dir, const hub_manifest *m, char *err) {
    json_t *root = json_object(), *files = json_array();
    json_object_set_new(root, "format", json_integer(1));
    json_object_set_new(root, "endpoint", json_string(m->endpoint));
    json_object_set_new(root, "repo", json_string(m->repo));
    json_object_set_new(root, "revision", json_string(m->revision));
    json_object_set_new(root, "commit", json_string(m->commit));
    json_object_set_new(root, "mode", json_string(hub_mode_name(m->mode)));
    json_object_set_new(root, "ready", json_boolean(m->ready));
    if (m->rate > 0) {
        json_object_set_new(root, "rate_bytes_per_s", json_real(m->rate));
        json_object_set_new(root, "rate_at", json_integer(m->rate_at));
    }
    if (m->cache_limit > 0) json_object_set_new(root, "cache_limit", json_integer(m->cache_limit));
    for (int i = 0; i < m->n_files; i++) {
        json_t *f = json_object();
        json_object_set_new(f, "path", json_string(m->files[i].path));
        json_object_set_new(f, "size", json_integer(m->files[i].size));
        json_object_set_new(f, "sha256", json_string(m->files[i].sha256));
        json_object_set_new(f, "git", json_string(m->files[i].git));
        json_object_set_new(f, "verified", json_boolean(m->verified[i]));
        json_array_append_new(files, f);
    }
    json_object_set_new(root, "files", files);
    char *hd = hub_pjoin(dir, HUB_DIR), *path = hd ? hub_pjoin(hd, "manifest.json") : NULL;
    char *tmp = path ? hub_pjoin(hd, "manifest.json.tmp") : NULL;
    df_status st = DF_OK;
    if (!tmp) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    else if (hub_mkdirs(hd) != 0) st = df_fail(err, DF_ERR_IO, "%s: cannot create: %s", hd, strerror(errno));
    else {
        char *text = json_dumps(root, JSON_INDENT(1));
        FILE *f = fopen(tmp, "w");
        int ok = text && f && fputs(text, f) >= 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
        if (f && fclose(f) != 0) ok = 0;
        free(text);
        if (!ok || rename(tmp, path) != 0)
            st = df_fail(err, DF_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
        else {
            int dfd = open(hd, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd >= 0) { fsync(dfd); close(dfd); }
        }
    }
    json_decref(root);
    free(hd); free(path); free(tmp);
    return st;
}

static char *jstrdup(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return strdup(json_is_string(v) ? json_string_value(v) : "");
}

/* DF_ERR_IO with errno ENOENT if dir has no manifest. */
df_status hub_manifest_load(const char *dir, hub_manifest *m, char *err) {
    memset(m, 0, sizeof *m);
    char *path = hub_pjoin(dir, HUB_DIR "/manifest.json");
    if (!path) return df_fail(err, DF_ERR_NOMEM, "out of memory");
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        int missing = access(path, F_OK) != 0;
        df_status st = df_fail(err, DF_ERR_IO, "%s: %s", path, missing ? "no hub mirror here (made by `deltafin setup`)" : je.text);
        free(path);
        errno = missing ? ENOENT : EINVAL;
        return st;
    }
    json_t *files = json_object_get(root, "files");
    const char *mode = json_string_value(json_object_get(root, "mode"));
    if (!json_is_array(files) || !mode) {
        json_decref(root);
        df_status st = df_fail(err, DF_ERR_FORMAT, "%s: 'files' or 'mode' missing", path);
        free(path);
        return st;
    }
    m->endpoint = jstrdup(root, "endpoint");
    m->repo = jstrdup(root, "repo");
    m->revision = jstrdup(root, "revision");
    m->commit = jstrdup(root, "commit");
    m->mode = !strcmp(mode, "stream") ? HUB_STREAM : HUB_FULL;
    m->ready = json_is_true(json_object_get(root, "ready"));
    m->rate = json_number_value(json_object_get(root, "rate_bytes_per_s"));
    m->rate_at = (int64_t)json_integer_value(json_object_get(root, "rate_at"));
    m->cache_limit = (int64_t)json_integer_value(json_object_get(root, "cache_limit"));
    if (m->rate < 0) m->rate = 0;
    if (m->cache_limit < 0) m->cache_limit = 0;
    size_t n = json_array_size(files);
    m->files = calloc(n ? n : 1, sizeof *m->files);
    m->verified = calloc(n ? n : 1, 1);
    df_status st = DF_OK;
    if (!m->files || !m->verified || !m->endpoint || !m->repo || !m->revision || !m->commit)
        st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    for (size_t i = 0; st == DF_OK && i < n; i++) {
        json_t *f = json_array_get(files, i);
        const char *p = json_string_value(json_object_get(f, "path"));
        const char *s = json_string_value(json_object_get(f, "sha256"));
        if (!p || strstr(p, "..") || p[0] == '/') { st = df_fail(err, DF_ERR_FORMAT, "%s: bad file entry %zu", path, i); break; }
        m->files[i].path = strdup(p);
        m->files[i].size = (int64_t)json_integer_value(json_object_get(f, "size"));
        snprintf(m->files[i].sha256, sizeof m->files[i].sha256, "%s", s ? s : "");
        const char *g = json_string_value(json_object_get(f, "git"));
        snprintf(m->files[i].git, sizeof m->files[i].git, "%s", g ? g : "");
        m->verified[i] = json_is_true(json_object_get(f, "verified"));
        m->n_files++;
        if (!m->files[i].path) st = df_fail(err, DF_ERR_NOMEM, "out of memory");
    }
    json_decref(root);
    free(path);
    if (st != DF_OK) hub_manifest_free(m);
    return st;
}
