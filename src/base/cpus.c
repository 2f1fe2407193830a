/* cpus.c — CPU lists, the CPUs the process may run on, and pinning (cpus.h).
 *
 * The allowed CPUs are the calling thread's affinity mask
 * (sched_getaffinity), which taskset, cgroups' cpusets and container
 * runtimes set; a list naming a CPU outside it would fail at
 * pthread_create, so it is refused at parse with the allowed ones named.
 * Owns df_cpus_parse too (deltafin.h: the CLI's --cpus).
 * Refuses: state (every call is self-contained).
 */
#include "cpus.h"
#include "deltafin.h"
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__) && defined(CPU_SETSIZE)
#define CPUS_PIN 1
#else
#define CPUS_PIN 0
#endif

#if CPUS_PIN
struct cpus_saved {
    cpu_set_t set;
};

/* "0-3,8" for the set: the allowed CPUs as a person reads them */
static void set_str(const cpu_set_t *set, char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    for (int c = 0; c < CPU_SETSIZE && len + 24 < cap; c++) {
        if (!CPU_ISSET(c, set)) continue;
        int e = c;
        while (e + 1 < CPU_SETSIZE && CPU_ISSET(e + 1, set)) e++;
        len += (size_t)snprintf(out + len, cap - len, e > c ? "%s%d-%d" : "%s%d", len ? "," : "", c, e);
        c = e;
    }
}
#endif

int cpus_check(const int *cpus, int n, char *err, size_t errcap) {
#if CPUS_PIN
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
        snprintf(err, errcap, "cannot read the CPUs this process may run on: %s", strerror(errno));
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE && CPU_ISSET(cpus[i], &allowed)) continue;
        char may[256];
        set_str(&allowed, may, sizeof may);
        snprintf(err, errcap, "CPU %d is not one this process may run on (it may run on %s)", cpus[i], may);
        return -1;
    }
    return 0;
#else
    (void)cpus;
    (void)n;
    snprintf(err, errcap, "pinning threads to CPUs needs Linux; leave the CPU list out");
    return -1;
#endif
}

/* a CPU number at *p, moving p past it; -1 if none or too large */
static int number(const char **p) {
    if (**p < '0' || **p > '9') return -1;
    long v = 0;
    while (**p >= '0' && **p <= '9') {
        v = v * 10 + (**p - '0');
        if (v >= CPUS_MAX) return -1;
        (*p)++;
    }
    return (int)v;
}

int cpus_parse(const char *s, int *cpus, int cap, char *err, size_t errcap) {
    int n = 0;
    const char *p = s;
    if (!s || !*s) {
        snprintf(err, errcap, "an empty CPU list (give CPU numbers and ranges, e.g. 0-3,8)");
        return -1;
    }
    for (;;) {
        const int a = number(&p);
        int b = a;
        if (a >= 0 && *p == '-') {
            p++;
            b = number(&p);
        }
        if (a < 0 || b < a || (*p && *p != ',')) {
            snprintf(err, errcap,
                     "cannot read the CPU list '%s': give numbers below %d and ranges lo-hi separated by commas, "
                     "e.g. 0-3,8",
                     s, CPUS_MAX);
            return -1;
        }
        for (int c = a; c <= b; c++) {
            for (int i = 0; i < n; i++)
                if (cpus[i] == c) {
                    snprintf(err, errcap, "CPU %d is listed twice in '%s'", c, s);
                    return -1;
                }
            if (n == cap) {
                snprintf(err, errcap, "the CPU list '%s' names more than %d CPUs", s, cap);
                return -1;
            }
            cpus[n++] = c;
        }
        if (!*p) break;
        p++;
    }
    return cpus_check(cpus, n, err, errcap) ? -1 : n;
}

int cpus_attr_pin(pthread_attr_t *attr, int cpu) {
#if CPUS_PIN
    if (cpu < 0 || cpu >= CPU_SETSIZE) return EINVAL;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_attr_setaffinity_np(attr, sizeof set, &set);
#else
    (void)attr;
    (void)cpu;
    return ENOTSUP;
#endif
}

int cpus_pin_self(int cpu, cpus_saved **saved) {
    if (saved) *saved = NULL;
#if CPUS_PIN
    if (cpu < 0 || cpu >= CPU_SETSIZE) return EINVAL;
    cpus_saved *sv = NULL;
    if (saved) {
        if (!(sv = malloc(sizeof *sv))) return ENOMEM;
        int rc = pthread_getaffinity_np(pthread_self(), sizeof sv->set, &sv->set);
        if (rc) { free(sv); return rc; }
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    if (rc) { free(sv); return rc; }
    if (saved) *saved = sv;
    return 0;
#else
    (void)cpu;
    return ENOTSUP;
#endif
}

void cpus_restore(cpus_saved *saved) {
#if CPUS_PIN
    if (saved) (void)pthread_setaffinity_np(pthread_self(), sizeof saved->set, &saved->set);
#endif
    free(saved);
}

int df_cpus_parse(const char *list, int *cpus, int cap, char *err) {
    return cpus_parse(list, cpus, cap, err, DF_ERRMSG);
}
