/*
 * main.c — the test runner, build/moeflow_tests.
 *
 *   moeflow_tests                 every test, each in its own forked process with a time limit
 *   moeflow_tests NAME...         the tests whose names start with any NAME
 *   moeflow_tests --list          the names, one per line, with their time limits
 *   moeflow_tests --no-fork ...   run in this process (for a debugger; a crash ends the run)
 *   moeflow_tests -v ...          also show the output of passing tests
 *
 * One line per test (`PASS name 0.12s` / `FAIL name 0.12s (why)`), the failing test's captured
 * output under it (its first 32 KB and last 64 KB), then a summary; the exit status is 1 when any
 * test failed. A test that runs past
 * its limit is killed with SIGKILL (communication bugs hang); a crash is reported with its signal.
 * Limits scale by MFT_TIMEOUT_SCALE (env) and by 3 under AddressSanitizer.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "problem.h"

/* Every area's table; each ends with a {NULL} entry. Add new areas here (and in harness.h). */
#ifdef MFT_GPU_SUITE
/* build/moeflow_gpu_tests: this file compiled again with MFT_GPU_SUITE (make test-gpu). */
static const mft_test_t *const mft_tables[] = {
    mft_tests_cuda,
    mft_tests_cuda_transport,
    mft_tests_cuda_balance,
    mft_tests_cuda_gemm_bounds,
    mft_tests_cuda_split,
    NULL,
};
#else
static const mft_test_t *const mft_tables[] = {
    mft_tests_numerics,
    mft_tests_quant,
    mft_tests_api,
    mft_tests_dispatch,
    mft_tests_layer,
    mft_tests_plan,
    mft_tests_transport,
    mft_tests_rendezvous,
    mft_tests_random,
    mft_tests_balance,
    mft_tests_placement,
    mft_tests_gemm_bounds,
    mft_tests_split,
    NULL,
};
#endif

#if defined(__SANITIZE_ADDRESS__)
#define MFT_SAN_SCALE 3.0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MFT_SAN_SCALE 3.0
#endif
#endif
#ifndef MFT_SAN_SCALE
#define MFT_SAN_SCALE 1.0
#endif

#define MFT_CAPTURE_HEAD (32 * 1024) /* of a test's output, the first bytes kept ... */
#define MFT_CAPTURE_TAIL (64 * 1024) /* ... and the last (a sanitizer report comes last) */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double timeout_of(const mft_test_t *t) {
    double scale = MFT_SAN_SCALE;
    const char *env = getenv("MFT_TIMEOUT_SCALE");
    if (env && atof(env) > 0) scale *= atof(env);
    return (t->timeout_s > 0 ? t->timeout_s : MFT_DEFAULT_TIMEOUT_S) * scale;
}

/* A test's output: its head, and a ring of its tail. */
typedef struct capture {
    char head[MFT_CAPTURE_HEAD];
    char tail[MFT_CAPTURE_TAIL];
    size_t head_len, total; /* total: bytes written by the test */
} capture_t;

static void capture_add(capture_t *c, const char *data, size_t n) {
    for (size_t i = 0; i < n; i++, c->total++) {
        if (c->head_len < MFT_CAPTURE_HEAD) c->head[c->head_len++] = data[i];
        else c->tail[(c->total - MFT_CAPTURE_HEAD) % MFT_CAPTURE_TAIL] = data[i];
    }
}

static void print_lines(const char *p, size_t n, int *at_line_start) {
    for (size_t i = 0; i < n; i++) {
        if (*at_line_start) fputs("    | ", stdout);
        putchar(p[i]);
        *at_line_start = p[i] == '\n';
    }
}

static void print_indented(const capture_t *c) {
    int bol = 1;
    print_lines(c->head, c->head_len, &bol);
    size_t rest = c->total - c->head_len;
    if (rest > MFT_CAPTURE_TAIL) {
        if (!bol) putchar('\n');
        printf("    | ... (%zu bytes of output left out) ...\n", rest - MFT_CAPTURE_TAIL);
        bol = 1;
        size_t start = (c->total - MFT_CAPTURE_HEAD) % MFT_CAPTURE_TAIL; /* oldest byte */
        print_lines(c->tail + start, MFT_CAPTURE_TAIL - start, &bol);
        print_lines(c->tail, start, &bol);
    } else {
        print_lines(c->tail, rest, &bol);
    }
    if (!bol) putchar('\n');
}

/* Runs one test in a child process; fills `why` on failure. Returns 0 on pass. */
static int run_forked(const mft_test_t *t, double *elapsed, char *why, size_t whylen,
                      capture_t *out) {
    int fds[2];
    double limit = timeout_of(t), t0 = now_s();
    fflush(stdout);
    fflush(stderr);
    if (pipe(fds) != 0) {
        snprintf(why, whylen, "pipe: %s", strerror(errno));
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(why, whylen, "fork: %s", strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return 1;
    }
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], STDOUT_FILENO);
        dup2(fds[1], STDERR_FILENO);
        close(fds[1]);
        setvbuf(stdout, NULL, _IONBF, 0);
        setvbuf(stderr, NULL, _IONBF, 0);
        int rc = t->fn();
        /* exit (not _exit): LeakSanitizer checks at exit, so a leak fails the test. */
        exit(rc ? 1 : 0);
    }
    close(fds[1]);

    int status = 0, exited = 0, timed_out = 0, eof = 0;
    while (!exited || !eof) {
        if (!eof) {
            struct pollfd pfd = {fds[0], POLLIN, 0};
            int n = poll(&pfd, 1, 20);
            if (n > 0) {
                char chunk[4096];
                ssize_t got = read(fds[0], chunk, sizeof chunk);
                if (got > 0)
                    capture_add(out, chunk, (size_t)got);
                else if (got == 0 || (errno != EINTR && errno != EAGAIN))
                    eof = 1;
            }
        } else {
            struct timespec ts = {0, 5 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (!exited) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid) exited = 1;
            else if (now_s() - t0 > limit) {
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                exited = 1;
                timed_out = 1;
                eof = 1; /* whatever it wrote so far is in `out` */
            }
        }
    }
    close(fds[0]);
    *elapsed = now_s() - t0;

    if (timed_out) {
        snprintf(why, whylen, "timeout: still running after %.0fs, killed with SIGKILL", limit);
        return 1;
    }
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        snprintf(why, whylen, "crashed: killed by signal %d (%s)", sig, strsignal(sig));
        return 1;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
        snprintf(why, whylen, "exit status %d", WEXITSTATUS(status));
        return 1;
    }
    return 0;
}

#ifdef MFT_GPU_SUITE
/* Asks a child whether CUDA is usable: CUDA must not be initialised in this process before it
 * forks the tests (a forked child cannot use a context its parent created). */
static int gpu_usable_in_child(void) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) _exit(mf_backend_available(MF_BACKEND_CUDA) ? 0 : 1);
    int status = 0;
    return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
#endif

static int matches(const char *name, int npat, char **pats) {
    if (npat == 0) return 1;
    for (int i = 0; i < npat; i++)
        if (strncmp(name, pats[i], strlen(pats[i])) == 0) return 1;
    return 0;
}

static void usage(const char *argv0) {
    fprintf(stderr, "usage: %s [--list] [--no-fork] [-v] [NAME-PREFIX...]\n", argv0);
}

int main(int argc, char **argv) {
    mfp_cuda_env();
    int list = 0, no_fork = 0, npat = 0;
    char **pats = (char **)calloc((size_t)argc + 1, sizeof *pats);
    if (!pats) return 2;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--list") == 0) list = 1;
        else if (strcmp(argv[i], "--has-gpu") == 0) { /* exit 0 when a CUDA device is usable */
            free(pats);
            return mf_backend_available(MF_BACKEND_CUDA) ? 0 : 1;
        }
        else if (strcmp(argv[i], "--no-fork") == 0) no_fork = 1;
        else if (strcmp(argv[i], "-v") == 0 || strcmp(argv[i], "--verbose") == 0)
            mft_verbose_on = 1;
        else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(argv[0]);
            free(pats);
            return 0;
        } else if (argv[i][0] == '-') {
            usage(argv[0]);
            free(pats);
            return 2;
        } else pats[npat++] = argv[i];
    }

    /* Every pattern must name at least one test: a typo must not pass as "0 failures". */
    for (int i = 0; i < npat; i++) {
        int hit = 0;
        for (int k = 0; mft_tables[k]; k++)
            for (const mft_test_t *t = mft_tables[k]; t->name; t++)
                if (strncmp(t->name, pats[i], strlen(pats[i])) == 0) hit = 1;
        if (!hit) {
            fprintf(stderr, "no test matches '%s' (see --list)\n", pats[i]);
            free(pats);
            return 2;
        }
    }

#ifdef MFT_GPU_SUITE
    if (!list && !no_fork && !gpu_usable_in_child()) {
        printf("# moeflow_gpu_tests: SKIP: no usable CUDA device (sm_90) found\n");
        free(pats);
        return 0;
    }
    if (!list && no_fork && !mf_backend_available(MF_BACKEND_CUDA)) {
        printf("# moeflow_gpu_tests: SKIP: no usable CUDA device (sm_90) in this process\n");
        free(pats);
        return 0;
    }
#endif
    if (list) {
        for (int k = 0; mft_tables[k]; k++)
            for (const mft_test_t *t = mft_tables[k]; t->name; t++)
                if (matches(t->name, npat, pats)) printf("%-40s %6.0fs\n", t->name, timeout_of(t));
        free(pats);
        return 0;
    }

    int run = 0, failed = 0;
    size_t failed_cap = 64, nfailed_names = 0;
    const char **failed_names = (const char **)calloc(failed_cap, sizeof *failed_names);
    double t_all = now_s();
    printf("# moeflow_tests: library version %d (header %d)%s\n", (int)mf_get_version(),
           MOEFLOW_VERSION_CODE, no_fork ? ", --no-fork" : "");
    for (int k = 0; mft_tables[k]; k++) {
        for (const mft_test_t *t = mft_tables[k]; t->name; t++) {
            if (!matches(t->name, npat, pats)) continue;
            char why[256] = "";
            double elapsed = 0;
            int rc;
            static capture_t out;
            out.head_len = out.total = 0;
            if (no_fork) {
                double t0 = now_s();
                fflush(stdout);
                rc = t->fn();
                elapsed = now_s() - t0;
                if (rc) snprintf(why, sizeof why, "returned %d", rc);
            } else {
                rc = run_forked(t, &elapsed, why, sizeof why, &out);
            }
            run++;
            if (rc) {
                failed++;
                printf("FAIL %s %.2fs (%s)\n", t->name, elapsed, why);
                print_indented(&out);
                if (nfailed_names == failed_cap) {
                    failed_cap *= 2;
                    const char **n = (const char **)realloc(failed_names,
                                                            failed_cap * sizeof *failed_names);
                    if (n) failed_names = n;
                }
                if (failed_names && nfailed_names < failed_cap)
                    failed_names[nfailed_names++] = t->name;
            } else {
                printf("PASS %s %.2fs\n", t->name, elapsed);
                if (mft_verbose_on) print_indented(&out);
            }
            fflush(stdout);
        }
    }
    printf("# %d tests, %d passed, %d failed, %.2fs\n", run, run - failed, failed,
           now_s() - t_all);
    if (failed) {
        printf("# failed:");
        for (size_t i = 0; i < nfailed_names; i++) printf(" %s", failed_names[i]);
        printf("\n");
    }
    free(failed_names);
    free(pats);
    return failed ? 1 : 0;
}
