/* common.c — the harnesses' shared helpers (see common.h): input parts, an
 * in-memory df_io table that counts descriptors, files on tmpfs.
 *
 * The in-memory table is safe from several threads (the safetensors reader
 * parses shard headers in parallel): one mutex guards the descriptor table.
 * Its mmap hands out a malloc'd copy of exactly the file's bytes, so a read
 * past the end of a "mapping" is a heap overflow AddressSanitizer reports.
 *
 * Sections: 1. parts  2. in-memory files  3. files on tmpfs  4. tokenizers
 */
#include "common.h"
#include "deltafin.h"
#include "../../src/text/text.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void fz_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz invariant broken: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

void fz_note(const char *fmt, ...) {
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("FZ_VERBOSE") != NULL;
    if (!verbose) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- 1. parts ---- */

int fz_split(const uint8_t *data, size_t n, fz_part *parts, int max) {
    const size_t sl = sizeof FZ_SEP - 1;
    int k = 0;
    const uint8_t *p = data, *end = data + n;
    while (k < max - 1) {
        const uint8_t *s = memmem(p, (size_t)(end - p), FZ_SEP, sl);
        if (!s) break;
        parts[k++] = (fz_part){p, (size_t)(s - p)};
        p = s + sl;
    }
    parts[k++] = (fz_part){p, (size_t)(end - p)};
    return k;
}

char *fz_strdup(fz_part p) {
    char *s = malloc(p.n + 1);
    if (!s) fz_die("out of memory");
    if (p.n) memcpy(s, p.p, p.n);
    s[p.n] = 0;
    return s;
}

/* ---- 2. in-memory files ---- */

typedef struct {
    char *name;
    const uint8_t *p;
    size_t n;
} mem_file;

struct fz_memfs {
    df_io io;
    char *root;
    mem_file files[FZ_MAX_FILES];
    int n_files;
    int fd_file[FZ_MAX_FDS]; /* file index + 1; 0 = closed */
    int maps;                /* mappings not yet unmapped */
    pthread_mutex_t mu;
};

enum { FD_BASE = 1000 }; /* well above anything real, so a mix-up shows */

static const mem_file *lookup(fz_memfs *fs, const char *path) {
    size_t rl = strlen(fs->root);
    if (strncmp(path, fs->root, rl) || path[rl] != '/') return NULL;
    for (int i = 0; i < fs->n_files; i++)
        if (!strcmp(fs->files[i].name, path + rl + 1)) return &fs->files[i];
    return NULL;
}

static const mem_file *of_fd(fz_memfs *fs, int fd) {
    const mem_file *f = NULL;
    pthread_mutex_lock(&fs->mu);
    if (fd >= FD_BASE && fd < FD_BASE + FZ_MAX_FDS && fs->fd_file[fd - FD_BASE])
        f = &fs->files[fs->fd_file[fd - FD_BASE] - 1];
    pthread_mutex_unlock(&fs->mu);
    return f;
}

static int m_open(void *ctx, const char *path, int flags, int mode) {
    (void)mode;
    fz_memfs *fs = ctx;
    if ((flags & O_ACCMODE) != O_RDONLY) { errno = EROFS; return -1; }
    pthread_mutex_lock(&fs->mu);
    const mem_file *f = lookup(fs, path);
    int fd = -1;
    if (!f) errno = ENOENT;
    else {
        for (int i = 0; i < FZ_MAX_FDS && fd < 0; i++)
            if (!fs->fd_file[i]) { fs->fd_file[i] = (int)(f - fs->files) + 1; fd = FD_BASE + i; }
        if (fd < 0) errno = EMFILE;
    }
    pthread_mutex_unlock(&fs->mu);
    return fd;
}

static int m_close(void *ctx, int fd) {
    fz_memfs *fs = ctx;
    int rc = -1;
    pthread_mutex_lock(&fs->mu);
    if (fd >= FD_BASE && fd < FD_BASE + FZ_MAX_FDS && fs->fd_file[fd - FD_BASE]) {
        fs->fd_file[fd - FD_BASE] = 0;
        rc = 0;
    }
    pthread_mutex_unlock(&fs->mu);
    if (rc) fz_die("close of descriptor %d, which is not open", fd);
    return rc;
}

static ssize_t m_pread(void *ctx, int fd, void *buf, size_t n, off_t off) {
    const mem_file *f = of_fd(ctx, fd);
    if (!f) fz_die("pread on descriptor %d, which is not open", fd);
    if (off < 0) { errno = EINVAL; return -1; }
    if ((uint64_t)off >= f->n) return 0;
    size_t k = f->n - (size_t)off < n ? f->n - (size_t)off : n;
    memcpy(buf, f->p + off, k);
    return (ssize_t)k;
}

static int m_fsize(void *ctx, int fd, int64_t *size) {
    const mem_file *f = of_fd(ctx, fd);
    if (!f) fz_die("fsize on descriptor %d, which is not open", fd);
    *size = (int64_t)f->n;
    return 0;
}

static void *m_mmap(void *ctx, size_t len, int fd) {
    fz_memfs *fs = ctx;
    const mem_file *f = of_fd(fs, fd);
    if (!f) fz_die("mmap of descriptor %d, which is not open", fd);
    if (len == 0 || len != f->n) { errno = EINVAL; return NULL; }
    void *p = malloc(len);
    if (!p) return NULL;
    memcpy(p, f->p, len);
    pthread_mutex_lock(&fs->mu);
    fs->maps++;
    pthread_mutex_unlock(&fs->mu);
    return p;
}

static int m_munmap(void *ctx, void *p, size_t len) {
    (void)len;
    fz_memfs *fs = ctx;
    free(p);
    pthread_mutex_lock(&fs->mu);
    fs->maps--;
    pthread_mutex_unlock(&fs->mu);
    return 0;
}

fz_memfs *fz_memfs_new(const char *root) {
    fz_memfs *fs = calloc(1, sizeof *fs);
    if (!fs || !(fs->root = strdup(root))) fz_die("out of memory");
    pthread_mutex_init(&fs->mu, NULL);
    fs->io = (df_io){.open = m_open, .close = m_close, .pread = m_pread, .fsize = m_fsize,
                     .mmap = m_mmap, .munmap = m_munmap, .ctx = fs};
    return fs;
}

void fz_memfs_add(fz_memfs *fs, const char *name, const void *p, size_t n) {
    for (int i = 0; i < fs->n_files; i++)
        if (!strcmp(fs->files[i].name, name)) { fs->files[i].p = p; fs->files[i].n = n; return; }
    if (fs->n_files == FZ_MAX_FILES) return;
    mem_file *f = &fs->files[fs->n_files++];
    if (!(f->name = strdup(name))) fz_die("out of memory");
    f->p = p;
    f->n = n;
}

const df_io *fz_memfs_io(fz_memfs *fs) { return &fs->io; }

void fz_memfs_reset(fz_memfs *fs) {
    for (int i = 0; i < FZ_MAX_FDS; i++)
        if (fs->fd_file[i]) fz_die("descriptor of %s left open", fs->files[fs->fd_file[i] - 1].name);
    if (fs->maps) fz_die("%d mapping(s) left", fs->maps);
    for (int i = 0; i < fs->n_files; i++) free(fs->files[i].name);
    fs->n_files = 0;
}

/* ---- 3. files on tmpfs ---- */

static char dir_path[256];

static void remove_dir(void) {
    if (!dir_path[0]) return;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir_path);
    if (system(cmd) != 0) {}
}

const char *fz_dir(void) {
    if (dir_path[0]) return dir_path;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir_path, sizeof dir_path, "%s/df-fuzz-%d", base, (int)getpid());
    if (mkdir(dir_path, 0700) != 0 && errno != EEXIST) fz_die("cannot create %s", dir_path);
    atexit(remove_dir);
    return dir_path;
}

const char *fz_file_path(const char *name) {
    static char paths[8][320];
    static int next;
    char *path = paths[next++ % 8];
    snprintf(path, sizeof paths[0], "%s/%s", fz_dir(), name);
    return path;
}

const char *fz_file(const char *name, const void *p, size_t n) {
    const char *path = fz_file_path(name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) fz_die("cannot create %s", path);
    const uint8_t *q = p;
    while (n) {
        ssize_t w = write(fd, q, n);
        if (w <= 0) fz_die("cannot write %s", path);
        q += w;
        n -= (size_t)w;
    }
    close(fd);
    return path;
}

/* ---- 4. tokenizers ---- */

void fz_tokenizer_check(const df_tokenizer *t, const char *text, size_t n, unsigned flags, const uint8_t *idb,
                        size_t nidb, int skip_special) {
    char err[DF_ERRMSG];
    df_tokens ids = {0};
    if (df_tokenize(t, text, n, flags, &ids, err) == DF_OK) {
        int special = 0;
        for (int i = 0; i < ids.n; i++) special |= df_tokenizer_is_special(t, ids.ids[i]);
        if (!special) {
            size_t at = 0;
            for (int i = 0; i < ids.n; i++) {
                size_t bl;
                const char *b = df_token_bytes(t, ids.ids[i], &bl);
                if (!b) fz_die("df_tokenize gave id %d, which has no bytes", ids.ids[i]);
                if (bl > n - at || memcmp(b, text + at, bl)) fz_die("token %d (id %d) is not the text at byte %zu", i, ids.ids[i], at);
                at += bl;
            }
            if (at != n) fz_die("the tokens cover %zu of %zu bytes", at, n);
            char *back;
            size_t bn;
            if (df_detokenize(t, ids.ids, ids.n, 0, &back, &bn, err) != DF_OK) fz_die("detokenize: %s", err);
            if (bn != n || memcmp(back, text, n)) fz_die("detokenize does not give the text back");
            free(back);
        }
    } else if (ids.n) {
        fz_die("a failed df_tokenize left %d ids", ids.n);
    }
    df_tokens_free(&ids);
    int nv = df_tokenizer_vocab_size(t);
    int m = (int)(nidb / 2);
    if (nv <= 0 || m == 0) return;
    int32_t *v = malloc((size_t)m * sizeof *v);
    if (!v) fz_die("out of memory");
    int k = 0;
    for (int i = 0; i < m; i++) {
        int32_t id = (int32_t)((idb[2 * i] | idb[2 * i + 1] << 8) % nv);
        if (df_token_bytes(t, id, NULL)) v[k++] = id; /* holes in the vocabulary are not ids */
    }
    char *whole;
    size_t wn;
    if (df_detokenize(t, v, k, skip_special, &whole, &wn, err) != DF_OK) fz_die("detokenize: %s", err);
    if (tok_utf8_check(whole, wn) != wn) fz_die("detokenize gave invalid UTF-8");
    df_detok *d;
    if (df_detok_new(t, skip_special, &d) != DF_OK) fz_die("detok_new");
    size_t at = 0;
    for (int i = 0; i <= k; i++) {
        const char *p;
        size_t pn;
        if (i < k) {
            if (df_detok_push(d, v[i], &p, &pn) != DF_OK) fz_die("detok_push of id %d", v[i]);
        } else {
            df_detok_flush(d, &p, &pn);
        }
        if (tok_utf8_check(p, pn) != pn) fz_die("a streamed piece is not valid UTF-8");
        if (pn > wn - at || memcmp(p, whole + at, pn)) fz_die("streamed decoding differs from whole at byte %zu", at);
        at += pn;
    }
    if (at != wn) fz_die("streamed decoding gave %zu of %zu bytes", at, wn);
    df_detok_free(d);
    free(whole);
    free(v);
}
