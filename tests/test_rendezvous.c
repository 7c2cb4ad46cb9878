/*
 * test_rendezvous.c — the built-in bootstrap (mf_rendezvous_address, mf_rendezvous_bootstrap and
 * its allgather), with ranks as real processes: the test makes one address, forks one child per
 * rank, and each child bootstraps, runs its script and exits 0 (as expected) or 1. The parent
 * waits with a deadline and kills stragglers; children die with it (PR_SET_PDEATHSIG).
 *
 * Covered: addresses (form, uniqueness, NULL); bad arguments (outputs untouched); R = 1 in
 * process, an in-place call, allocation failure; R = 1, 2, 4, 8 as processes with allgathers of
 * 0, 1, 13 bytes, 1 MiB and 3 MiB + 5, every block compared bitwise against a payload that encodes
 * (group, call, rank, byte), the bytes past the result untouched, every new fd close-on-exec and
 * none left after destroy; rank 0 starting late; a rank or rank 0 that never arrives
 * (MF_ERR_TIMEOUT naming the missing rank, within the timeout); ranks absent under start-up skew,
 * rank 0 last or every rank at random, R = 3 and 8 (every rank that arrived names the absent ones,
 * whoever's timeout ends first); a rank 0 that accepts and then hangs (bounded: the timeout and
 * the verdict's grace); a rank or rank 0 that exits after
 * the rendezvous (the next allgather fails at once on the others, naming it, and every later call
 * fails too); a rank that hangs instead of calling the allgather (MF_ERR_TIMEOUT naming it); a
 * rank that dies in the middle of 8 MiB allgathers (no hang, whatever the phase); `bytes` that differ
 * (a large block against a small one, so a sender is cut short); two processes given one rank;
 * ranks that disagree on num_ranks; a second rank 0 at a busy address; two groups at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h" /* mf__test_fail_alloc_after: the allocator's failure switch */
#include "harness.h"

#define RDV_TIMEOUT_MS 5000       /* a healthy group's bootstrap timeout */
#define RDV_SHORT_TIMEOUT_MS 500  /* where a rank is expected not to arrive */
#define RDV_SLACK_MS 2000         /* how late past a timeout a failure may come (sanitizers) */
#define RDV_WAIT_S 20.0           /* the parent's deadline for its children */
#define RDV_MAX_PROCS 16
#define RDV_MAX_FD 1024           /* fds checked for leaks and close-on-exec */

static double rdv_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void rdv_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* ---- processes ---------------------------------------------------------------------------- */

/* One child: which rank of which group it plays, and what it does. */
typedef struct rdv_proc {
    int32_t rank, num_ranks;
    const char *address;
    int group;      /* mixed into the payloads, so groups that mix up their data fail */
    int64_t timeout_ms;
    int role;       /* the script's switch: what this child does differently */
} rdv_proc_t;

typedef int (*rdv_child_fn)(const rdv_proc_t *p);

/* Forks one child per entry of `procs` (each runs fn and exits with its result) and waits for
 * them all. Returns 0 when every child exited 0 within RDV_WAIT_S; kills the rest otherwise. */
static int rdv_run(const rdv_proc_t *procs, int n, rdv_child_fn fn) {
    pid_t pids[RDV_MAX_PROCS];
    int status[RDV_MAX_PROCS], done[RDV_MAX_PROCS] = {0};
    pid_t parent = getpid();
    int failed = 0, started = 0;
    fflush(stdout);
    fflush(stderr);
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0) {
            mft_fail(__FILE__, __LINE__, "fork: %s", strerror(errno));
            failed = 1;
            break;
        }
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(3); /* the parent died before prctl */
            int rc = fn(&procs[i]);
            if (rc)
                mft_note("(that was rank %d of %d, group %d)", (int)procs[i].rank,
                         (int)procs[i].num_ranks, procs[i].group);
            exit(rc ? 1 : 0); /* exit, not _exit: LeakSanitizer checks each child */
        }
        pids[started++] = pid;
    }
    double deadline = rdv_now_ms() + RDV_WAIT_S * 1e3;
    int left = started;
    while (left > 0) {
        for (int i = 0; i < started; i++) {
            if (done[i]) continue;
            pid_t w = waitpid(pids[i], &status[i], WNOHANG);
            if (w == pids[i]) {
                done[i] = 1;
                left--;
            }
        }
        if (left == 0) break;
        if (rdv_now_ms() > deadline) {
            for (int i = 0; i < started; i++) {
                if (done[i]) continue;
                mft_fail(__FILE__, __LINE__, "rank %d of %d (group %d) still running after %.0f s: "
                         "killed", (int)procs[i].rank, (int)procs[i].num_ranks, procs[i].group,
                         RDV_WAIT_S);
                kill(pids[i], SIGKILL);
                waitpid(pids[i], &status[i], 0);
                done[i] = 1;
                status[i] = -1;
                failed = 1;
            }
            break;
        }
        rdv_sleep_ms(2);
    }
    for (int i = 0; i < started; i++) {
        if (status[i] == -1) continue;
        if (WIFSIGNALED(status[i])) {
            mft_fail(__FILE__, __LINE__, "rank %d of %d (group %d) killed by signal %d",
                     (int)procs[i].rank, (int)procs[i].num_ranks, procs[i].group,
                     WTERMSIG(status[i]));
            failed = 1;
        } else if (WEXITSTATUS(status[i]) != 0) {
            mft_fail(__FILE__, __LINE__, "rank %d of %d (group %d) exited with %d",
                     (int)procs[i].rank, (int)procs[i].num_ranks, procs[i].group,
                     WEXITSTATUS(status[i]));
            failed = 1;
        }
    }
    return failed;
}

/* One group of R processes at `address`, rank r with role roles ? roles[r] : 0. */
static int rdv_run_group(int32_t R, const char *address, int64_t timeout_ms, const int *roles,
                         rdv_child_fn fn) {
    rdv_proc_t procs[RDV_MAX_PROCS];
    for (int32_t r = 0; r < R; r++)
        procs[r] = (rdv_proc_t){r, R, address, 0, timeout_ms, roles ? roles[r] : 0};
    return rdv_run(procs, (int)R, fn);
}

/* ---- payloads and fds ------------------------------------------------------------------------ */

/* Byte i of `rank`'s block in allgather `call` of `group`. */
static void rdv_fill(uint8_t *p, size_t bytes, int group, int call, int32_t rank) {
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t h = mft_hash4((uint64_t)group, (uint64_t)call, (uint64_t)rank, i / 8);
        for (size_t j = 0; j < 8 && i + j < bytes; j++) p[i + j] = (uint8_t)(h >> (8 * j));
    }
}

/* Compares every rank's block of recv [R, bytes] bitwise; names the first wrong byte. */
static int rdv_check_blocks(const uint8_t *recv, size_t bytes, int32_t R, int group, int call,
                            uint8_t *scratch) {
    for (int32_t r = 0; r < R; r++) {
        rdv_fill(scratch, bytes, group, call, r);
        const uint8_t *got = recv + (size_t)r * bytes;
        if (bytes && memcmp(got, scratch, bytes) != 0) {
            size_t i = 0;
            while (got[i] == scratch[i]) i++;
            MFT_FAIL("allgather %d (%zu bytes): block of rank %d differs at byte %zu: 0x%02x, "
                     "expected 0x%02x", call, bytes, (int)r, i, got[i], scratch[i]);
        }
    }
    return 0;
}

static int rdv_fd_open(int fd) { return fcntl(fd, F_GETFD) != -1; }

static int rdv_count_fds(void) {
    int n = 0;
    for (int fd = 0; fd < RDV_MAX_FD; fd++) n += rdv_fd_open(fd);
    return n;
}

/* ---- addresses and arguments (no peers) ------------------------------------------------------- */

static int test_address(void) {
    char a[MF_ADDRESS_BYTES], b[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(a));
    MFT_CHECK_OK(mf_rendezvous_address(b));
    mft_verbose("  %s\n  %s\n", a, b);
    MFT_CHECK(strncmp(a, "unix:", 5) == 0 && strlen(a) > 5);
    MFT_CHECK(strlen(a) < MF_ADDRESS_BYTES);
    MFT_CHECK_MSG(strcmp(a, b) != 0, "two addresses are equal: %s", a);
    MFT_CHECK_ERR(mf_rendezvous_address(NULL), MF_ERR_INVALID_ARGUMENT);
    return 0;
}

static int expect_bootstrap_rejected(const char *address, int32_t rank, int32_t R, int64_t timeout,
                                     mf_bootstrap_t *bs, mf_result_t code, const char *needle) {
    mf_bootstrap_t before;
    mft_poison(&before, sizeof before);
    if (bs) memcpy(bs, &before, sizeof before);
    MFT_CHECK_ERR(mf_rendezvous_bootstrap(address, rank, R, timeout, bs), code);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), needle), "\"%s\" does not name \"%s\"",
                  mf_last_error(), needle);
    if (bs) MFT_CHECK_MSG(memcmp(bs, &before, sizeof before) == 0, "*bootstrap was written");
    return 0;
}

static int test_args(void) {
    char addr[MF_ADDRESS_BYTES], long_addr[MF_ADDRESS_BYTES + 8];
    mf_bootstrap_t bs;
    int fds_before = rdv_count_fds();
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    const mf_result_t INV = MF_ERR_INVALID_ARGUMENT;
    if (expect_bootstrap_rejected(addr, 0, 2, 100, NULL, INV, "bootstrap")) return 1;
    if (expect_bootstrap_rejected(NULL, 0, 2, 100, &bs, INV, "address")) return 1;
    if (expect_bootstrap_rejected(addr, -1, 2, 100, &bs, INV, "rank")) return 1;
    if (expect_bootstrap_rejected(addr, 2, 2, 100, &bs, INV, "rank")) return 1;
    if (expect_bootstrap_rejected(addr, 0, 0, 100, &bs, INV, "num_ranks")) return 1;
    if (expect_bootstrap_rejected(addr, 0, -3, 100, &bs, INV, "num_ranks")) return 1;
    if (expect_bootstrap_rejected(addr, 0, MF_MAX_RANKS + 1, 100, &bs, INV, "num_ranks")) return 1;
    if (expect_bootstrap_rejected(addr, 0, 2, -1, &bs, INV, "timeout")) return 1;
    if (expect_bootstrap_rejected("tcp:127.0.0.1:1234", 0, 2, 100, &bs, INV, "unix:")) return 1;
    if (expect_bootstrap_rejected("moeflow-1", 0, 1, 100, &bs, INV, "unix:")) return 1;
    if (expect_bootstrap_rejected("unix:", 0, 2, 100, &bs, INV, "name")) return 1;
    /* A name of 107 bytes fills sun_path after its leading '\0' (R = 1 opens no socket) ... */
    memset(long_addr, 'x', sizeof long_addr);
    memcpy(long_addr, "unix:", 5);
    long_addr[5 + 107] = '\0';
    MFT_CHECK_OK(mf_rendezvous_bootstrap(long_addr, 0, 1, 100, &bs));
    bs.destroy(bs.ctx);
    long_addr[5 + 107] = 'x'; /* ... one of 108 does not */
    long_addr[5 + 108] = '\0';
    if (expect_bootstrap_rejected(long_addr, 0, 2, 100, &bs, INV, "name")) return 1;
    long_addr[5 + 108] = 'x';
    long_addr[sizeof long_addr - 1] = '\0'; /* longer than MF_ADDRESS_BYTES */
    if (expect_bootstrap_rejected(long_addr, 0, 2, 100, &bs, INV, "MF_ADDRESS_BYTES")) return 1;
    MFT_CHECK_EQ_INT(rdv_count_fds(), fds_before); /* the failed calls opened nothing */
    return 0;
}

/* R = 1: no socket; the allgather copies, also in place; a NULL block then breaks it for good. */
static int single_rank(mf_bootstrap_t *bs) {
    const char *addr = "unix:moeflow-test-single";
    int fds_before = rdv_count_fds();
    MFT_CHECK_OK(mf_rendezvous_bootstrap(addr, 0, 1, 0, bs));
    MFT_CHECK(bs->allgather != NULL && bs->destroy != NULL && bs->ctx != NULL);
    MFT_CHECK_EQ_INT(rdv_count_fds(), fds_before);
    uint8_t send[13], recv[13 + 8];
    rdv_fill(send, sizeof send, 0, 0, 0);
    mft_poison(recv, sizeof recv);
    MFT_CHECK_EQ_INT(bs->allgather(bs->ctx, send, recv, sizeof send), 0);
    MFT_CHECK(memcmp(send, recv, sizeof send) == 0);
    MFT_CHECK_EQ_INT(mft_first_unpoisoned(recv + 13, 8), -1);
    MFT_CHECK_EQ_INT(bs->allgather(bs->ctx, recv, recv, sizeof send), 0); /* in place */
    MFT_CHECK(memcmp(send, recv, sizeof send) == 0);
    MFT_CHECK_EQ_INT(bs->allgather(bs->ctx, NULL, NULL, 0), 0);
    MFT_CHECK(bs->allgather(bs->ctx, NULL, recv, 4) != 0);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), "NULL"), "%s", mf_last_error());
    MFT_CHECK(bs->allgather(bs->ctx, send, recv, 4) != 0);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), "earlier failure"), "%s", mf_last_error());
    return 0;
}

static int test_single(void) {
    mf_bootstrap_t bs = {NULL, NULL, NULL};
    int rc = single_rank(&bs);
    if (bs.destroy) bs.destroy(bs.ctx);

    /* Out of memory: reported, nothing written. */
    mf_bootstrap_t before;
    mft_poison(&before, sizeof before);
    memcpy(&bs, &before, sizeof bs);
    mf__test_fail_alloc_after(1);
    mf_result_t r = mf_rendezvous_bootstrap("unix:moeflow-test-oom", 0, 1, 0, &bs);
    mf__test_fail_alloc_after(0);
    MFT_CHECK_EQ_INT(r, MF_ERR_OUT_OF_MEMORY);
    MFT_CHECK(memcmp(&bs, &before, sizeof bs) == 0);
    return rc;
}

/* ---- healthy groups ------------------------------------------------------------------------- */

static const size_t rdv_sizes[] = {0, 1, 13, 1u << 20, (3u << 20) + 5, 13, 0};
#define RDV_NUM_SIZES (int)(sizeof rdv_sizes / sizeof rdv_sizes[0])

/* Bootstraps, runs every size of rdv_sizes and checks each result; checks fds on the way. */
static int child_allgathers(const rdv_proc_t *p) {
    static uint8_t was_open[RDV_MAX_FD];
    for (int fd = 0; fd < RDV_MAX_FD; fd++) was_open[fd] = (uint8_t)rdv_fd_open(fd);
    int fds_before = rdv_count_fds();

    mf_bootstrap_t bs;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs));
    int new_fds = 0;
    for (int fd = 0; fd < RDV_MAX_FD; fd++) {
        if (was_open[fd] || !rdv_fd_open(fd)) continue;
        new_fds++;
        MFT_CHECK_MSG(fcntl(fd, F_GETFD) & FD_CLOEXEC, "fd %d is not close-on-exec", fd);
    }
    /* R = 1: none; rank 0: one per peer (the listening socket is closed); others: one. */
    int expected = p->num_ranks == 1 ? 0 : p->rank == 0 ? (int)p->num_ranks - 1 : 1;
    MFT_CHECK_EQ_INT(new_fds, expected);

    size_t max = 0;
    for (int c = 0; c < RDV_NUM_SIZES; c++) max = rdv_sizes[c] > max ? rdv_sizes[c] : max;
    const size_t guard = 64;
    uint8_t *send = (uint8_t *)mft_alloc(max);
    uint8_t *recv = (uint8_t *)mft_alloc((size_t)p->num_ranks * max + guard);
    uint8_t *scratch = (uint8_t *)mft_alloc(max);
    int rc = 0;
    for (int c = 0; c < RDV_NUM_SIZES && rc == 0; c++) {
        size_t bytes = rdv_sizes[c], total = (size_t)p->num_ranks * bytes;
        rdv_fill(send, bytes, p->group, c, p->rank);
        mft_poison(recv, total + guard);
        int32_t st = bs.allgather(bs.ctx, send, recv, bytes);
        if (st != 0) {
            rc = mft_fail(__FILE__, __LINE__, "allgather %d (%zu bytes) -> %d: %s", c, bytes,
                          (int)st, mf_last_error());
            break;
        }
        rc = rdv_check_blocks(recv, bytes, p->num_ranks, p->group, c, scratch);
        if (!rc && mft_first_unpoisoned(recv + total, guard) != -1)
            rc = mft_fail(__FILE__, __LINE__, "allgather %d wrote past R * bytes", c);
    }
    if (!rc && bs.allgather(bs.ctx, NULL, NULL, 0) != 0) /* no block: no buffers needed */
        rc = mft_fail(__FILE__, __LINE__, "allgather(NULL, NULL, 0): %s", mf_last_error());
    free(send);
    free(recv);
    free(scratch);
    bs.destroy(bs.ctx);
    MFT_CHECK_EQ_INT(rdv_count_fds(), fds_before);
    return rc;
}

static int rdv_allgather_group(int32_t R) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    double t0 = rdv_now_ms();
    int rc = rdv_run_group(R, addr, RDV_TIMEOUT_MS, NULL, child_allgathers);
    mft_verbose("  R = %d: %.0f ms\n", (int)R, rdv_now_ms() - t0);
    return rc;
}

static int test_allgather_1(void) { return rdv_allgather_group(1); }
static int test_allgather_2(void) { return rdv_allgather_group(2); }
static int test_allgather_4(void) { return rdv_allgather_group(4); }
static int test_allgather_8(void) { return rdv_allgather_group(8); }

/* Rank 0 starts late: the others keep trying to connect until it listens. */
static int child_late_root(const rdv_proc_t *p) {
    if (p->rank == 0) rdv_sleep_ms(300);
    return child_allgathers(p);
}

static int test_late_root(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    return rdv_run_group(4, addr, RDV_TIMEOUT_MS, NULL, child_late_root);
}

static int test_two_groups(void) {
    char a[MF_ADDRESS_BYTES], b[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(a));
    MFT_CHECK_OK(mf_rendezvous_address(b));
    rdv_proc_t procs[8];
    for (int32_t r = 0; r < 4; r++) {
        procs[r] = (rdv_proc_t){r, 4, a, 1, RDV_TIMEOUT_MS, 0};
        procs[4 + r] = (rdv_proc_t){r, 4, b, 2, RDV_TIMEOUT_MS, 0};
    }
    return rdv_run(procs, 8, child_allgathers);
}

/* ---- a rank that never arrives ------------------------------------------------------------- */

enum { ROLE_NORMAL = 0, ROLE_ABSENT = 1, ROLE_LEAVE = 2, ROLE_BIG = 3, ROLE_PATIENT = 4 };

/* Expects MF_ERR_TIMEOUT within its timeout (+ slack), naming rank `missing`: rank 0 knows, and
 * tells every rank that arrived (the patient ones hear it well before their own timeout). */
static int child_expect_timeout(const rdv_proc_t *p) {
    if (p->role == ROLE_ABSENT) return 0;
    int32_t missing = p->num_ranks - 1;
    mf_bootstrap_t bs, before;
    mft_poison(&before, sizeof before);
    memcpy(&bs, &before, sizeof bs);
    int fds_before = rdv_count_fds();
    double t0 = rdv_now_ms();
    MFT_CHECK_ERR(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs),
                  MF_ERR_TIMEOUT);
    double ms = rdv_now_ms() - t0;
    MFT_CHECK_MSG(ms < (double)(p->timeout_ms + RDV_SLACK_MS), "took %.0f ms", ms);
    MFT_CHECK(memcmp(&bs, &before, sizeof bs) == 0);
    MFT_CHECK_EQ_INT(rdv_count_fds(), fds_before);
    char needle[64];
    snprintf(needle, sizeof needle, "rank %d of %d did not arrive", (int)missing, (int)p->num_ranks);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), needle), "\"%s\" does not say \"%s\"",
                  mf_last_error(), needle);
    if (p->role == ROLE_PATIENT) MFT_CHECK_MSG(ms < RDV_SHORT_TIMEOUT_MS + RDV_SLACK_MS, "took %.0f ms", ms);
    return 0;
}

static int test_missing_rank(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    /* Rank 3 of 4 never calls; rank 0 waits 500 ms; rank 1 too; rank 2 would wait 10 s. */
    rdv_proc_t procs[4] = {
        {0, 4, addr, 0, RDV_SHORT_TIMEOUT_MS, ROLE_NORMAL},
        {1, 4, addr, 0, RDV_SHORT_TIMEOUT_MS, ROLE_NORMAL},
        {2, 4, addr, 0, 10000, ROLE_PATIENT},
        {3, 4, addr, 0, RDV_SHORT_TIMEOUT_MS, ROLE_ABSENT},
    };
    return rdv_run(procs, 4, child_expect_timeout);
}

static int child_root_absent(const rdv_proc_t *p) {
    if (p->rank == 0) return 0;
    double t0 = rdv_now_ms();
    mf_bootstrap_t bs;
    MFT_CHECK_ERR(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs),
                  MF_ERR_TIMEOUT);
    double ms = rdv_now_ms() - t0;
    MFT_CHECK_MSG(ms >= (double)p->timeout_ms - 5 && ms < (double)(p->timeout_ms + RDV_SLACK_MS),
                  "took %.0f ms", ms);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), "rank 0"), "%s", mf_last_error());
    return 0;
}

static int test_missing_root(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    return rdv_run_group(3, addr, RDV_SHORT_TIMEOUT_MS, NULL, child_root_absent);
}

/* ---- the verdict under start-up skew ---------------------------------------------------------- */

/* Ranks start at different times (rank 0, the listener, last; or each at random) and some never
 * start: every rank that arrived must report the same MF_ERR_TIMEOUT, naming the absent ranks,
 * whoever's timeout ends first (issue 26: a rank that arrived before rank 0 blamed rank 0). The
 * skew stays well inside the timeout, so every present rank is connected when the verdict falls. */
#define RDV_SKEW_TIMEOUT_MS 800
#define RDV_SKEW_MAX_MS 200
#define RDV_SKEW_REPEATS 3

/* "rank 2 of 3 did not arrive" / "ranks 3, 5 of 8 did not arrive": the absent ranks as named. */
static void rdv_absent_note(uint64_t absent, int32_t R, char *out, size_t size) {
    char list[128] = "";
    size_t at = 0;
    for (int32_t r = 0; r < R; r++)
        if (absent & ((uint64_t)1 << r))
            at += (size_t)snprintf(list + at, sizeof list - at, "%s%d", at ? ", " : "", (int)r);
    snprintf(out, size, "rank%s %s of %d did not arrive", (absent & (absent - 1)) ? "s" : "", list,
             (int)R);
}

/* The parent's plan for the children it forks (they inherit it): per group, each rank's start-up
 * delay and the ranks that never arrive. */
static struct {
    int delay_ms[2][RDV_MAX_PROCS];
    uint64_t absent[2];
} rdv_skew;

static int child_skewed(const rdv_proc_t *p) {
    const uint64_t absent = rdv_skew.absent[p->group];
    const int delay_ms = rdv_skew.delay_ms[p->group][p->rank];
    if (absent & ((uint64_t)1 << p->rank)) return 0;
    rdv_sleep_ms(delay_ms);
    mf_bootstrap_t bs;
    double t0 = rdv_now_ms();
    mf_result_t res = mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs);
    double ms = rdv_now_ms() - t0;
    char needle[160];
    rdv_absent_note(absent, p->num_ranks, needle, sizeof needle);
    mft_verbose("  R = %d, rank %d (+%d ms): %d after %.0f ms: %s\n", (int)p->num_ranks, (int)p->rank,
                delay_ms, (int)res, ms, mf_last_error());
    if (res == MF_SUCCESS) bs.destroy(bs.ctx);
    MFT_CHECK_MSG(res == MF_ERR_TIMEOUT, "-> %d, expected MF_ERR_TIMEOUT: %s", (int)res, mf_last_error());
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), needle), "\"%s\" does not say \"%s\"",
                  mf_last_error(), needle);
    MFT_CHECK_MSG(ms < (double)(p->timeout_ms + RDV_SLACK_MS), "took %.0f ms", ms);
    return 0;
}

/* One repetition: a group of 3 and a group of 8 at once, each with its skew and absent ranks. */
static int rdv_skew_round(int listener_last, int rep) {
    static const int32_t sizes[2] = {3, 8};
    char addr[2][MF_ADDRESS_BYTES];
    rdv_proc_t procs[3 + 8];
    int n = 0;
    for (int g = 0; g < 2; g++) {
        const int32_t R = sizes[g];
        MFT_CHECK_OK(mf_rendezvous_address(addr[g]));
        uint64_t h = mft_hash4(26, (uint64_t)listener_last, (uint64_t)rep, (uint64_t)R);
        /* Listener last: rank R - 1 absent, as in the issue; random: one or two of ranks 1..R-1. */
        uint64_t absent = (uint64_t)1 << (listener_last ? R - 1 : 1 + (int32_t)(h % (uint64_t)(R - 1)));
        if (!listener_last && R > 3 && (h >> 8) % 2)
            absent |= (uint64_t)1 << (1 + (int32_t)((h >> 16) % (uint64_t)(R - 1)));
        rdv_skew.absent[g] = absent;
        for (int32_t r = 0; r < R; r++) {
            int delay = (int)(mft_hash4(h, (uint64_t)r, 0, 0) % (RDV_SKEW_MAX_MS + 1));
            rdv_skew.delay_ms[g][r] = !listener_last ? delay : r == 0 ? RDV_SKEW_MAX_MS : delay / 2;
            procs[n++] = (rdv_proc_t){r, R, addr[g], g, RDV_SKEW_TIMEOUT_MS, 0};
        }
    }
    return rdv_run(procs, n, child_skewed);
}

static int test_skew_listener_last(void) {
    for (int rep = 0; rep < RDV_SKEW_REPEATS; rep++)
        if (rdv_skew_round(1, rep)) return mft_fail(__FILE__, __LINE__, "repetition %d", rep);
    return 0;
}

static int test_skew_random(void) {
    for (int rep = 0; rep < RDV_SKEW_REPEATS; rep++)
        if (rdv_skew_round(0, rep)) return mft_fail(__FILE__, __LINE__, "repetition %d", rep);
    return 0;
}

/* A rank 0 that hangs after accepting (a stand-in that listens at the address, takes the HELLO
 * and never answers): rank 1 waits for the verdict no longer than its timeout plus the grace the
 * library gives rank 0 (1 s, src/transport/rendezvous.c), and says that rank 0 gave none. */
#define RDV_VERDICT_GRACE_MS 1000

static int child_silent_root(const rdv_proc_t *p) {
    if (p->rank == 0) {
        struct sockaddr_un sa;
        memset(&sa, 0, sizeof sa);
        sa.sun_family = AF_UNIX;
        const char *name = p->address + 5; /* after "unix:"; sun_path[0] = '\0': abstract */
        memcpy(sa.sun_path + 1, name, strlen(name));
        socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name));
        int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
        MFT_CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, len) == 0 && listen(lfd, 1) == 0);
        int fd = accept(lfd, NULL, NULL);
        MFT_CHECK(fd >= 0);
        char buf[64];
        MFT_CHECK(read(fd, buf, sizeof buf) > 0); /* the HELLO; then silence until rank 1 leaves */
        struct pollfd pfd = {fd, POLLIN, 0};
        while (poll(&pfd, 1, (int)p->timeout_ms + RDV_VERDICT_GRACE_MS + RDV_SLACK_MS) > 0 &&
               read(fd, buf, sizeof buf) > 0) {}
        close(fd);
        close(lfd);
        return 0;
    }
    mf_bootstrap_t bs;
    double t0 = rdv_now_ms();
    MFT_CHECK_ERR(mf_rendezvous_bootstrap(p->address, 1, 2, p->timeout_ms, &bs), MF_ERR_TIMEOUT);
    double ms = rdv_now_ms() - t0, bound = (double)(p->timeout_ms + RDV_VERDICT_GRACE_MS);
    MFT_CHECK_MSG(ms >= bound - 5 && ms < bound + RDV_SLACK_MS, "took %.0f ms", ms);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), "rank 0 gave no verdict"), "%s", mf_last_error());
    return 0;
}

static int test_silent_root(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    return rdv_run_group(2, addr, RDV_SHORT_TIMEOUT_MS, NULL, child_silent_root);
}

/* ---- a rank that leaves, bytes that differ --------------------------------------------------- */

/* Bootstraps; ROLE_LEAVE exits at once (as if it crashed: no destroy, no allgather); the others'
 * allgather must fail fast naming rank `p->group` (the leaver), and every later call too. */
static int child_leave(const rdv_proc_t *p) {
    mf_bootstrap_t bs;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs));
    if (p->role == ROLE_LEAVE) _exit(0);
    uint8_t send[8] = {1, 2, 3, 4, 5, 6, 7, 8}, recv[8 * 8];
    double t0 = rdv_now_ms();
    int32_t st = bs.allgather(bs.ctx, send, recv, sizeof send);
    double ms = rdv_now_ms() - t0;
    int rc = 0;
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d", p->group);
    if (st == 0) rc = mft_fail(__FILE__, __LINE__, "the allgather succeeded without rank %d", p->group);
    else if (ms > (double)p->timeout_ms / 2)
        rc = mft_fail(__FILE__, __LINE__, "the failure took %.0f ms (a timeout, not EOF)", ms);
    else if (!mft_contains_ci(mf_last_error(), needle) || !mft_contains_ci(mf_last_error(), "closed"))
        rc = mft_fail(__FILE__, __LINE__, "\"%s\" does not say %s closed its connection",
                      mf_last_error(), needle);
    mft_verbose("  rank %d: %d after %.0f ms: %s\n", (int)p->rank, (int)st, ms, mf_last_error());
    if (!rc) {
        t0 = rdv_now_ms();
        if (bs.allgather(bs.ctx, send, recv, sizeof send) == 0)
            rc = mft_fail(__FILE__, __LINE__, "a later allgather succeeded");
        else if (!mft_contains_ci(mf_last_error(), "earlier failure") || rdv_now_ms() - t0 > 50)
            rc = mft_fail(__FILE__, __LINE__, "a later allgather: \"%s\" after %.0f ms",
                          mf_last_error(), rdv_now_ms() - t0);
    }
    bs.destroy(bs.ctx);
    return rc;
}

static int test_rank_leaves(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    rdv_proc_t procs[4];
    for (int32_t r = 0; r < 4; r++)
        procs[r] = (rdv_proc_t){r, 4, addr, 2, RDV_TIMEOUT_MS, r == 2 ? ROLE_LEAVE : ROLE_NORMAL};
    return rdv_run(procs, 4, child_leave);
}

static int test_root_leaves(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    rdv_proc_t procs[4];
    for (int32_t r = 0; r < 4; r++)
        procs[r] = (rdv_proc_t){r, 4, addr, 0, RDV_TIMEOUT_MS, r == 0 ? ROLE_LEAVE : ROLE_NORMAL};
    return rdv_run(procs, 4, child_leave);
}

/* ROLE_LEAVE bootstraps and then hangs (sleeps past rank 0's timeout) instead of calling the
 * allgather: rank 0 (500 ms) names it in MF_ERR_TIMEOUT, and tells the others (2 s) so. */
static int child_stall(const rdv_proc_t *p) {
    mf_bootstrap_t bs;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs));
    if (p->role == ROLE_LEAVE) {
        rdv_sleep_ms(RDV_SHORT_TIMEOUT_MS + 300);
        _exit(0);
    }
    uint8_t send[8] = {0}, recv[8 * 8];
    double t0 = rdv_now_ms();
    int32_t st = bs.allgather(bs.ctx, send, recv, sizeof send);
    double ms = rdv_now_ms() - t0;
    mft_verbose("  rank %d: %d after %.0f ms: %s\n", (int)p->rank, (int)st, ms, mf_last_error());
    int rc = 0;
    if (st != MF_ERR_TIMEOUT)
        rc = mft_fail(__FILE__, __LINE__, "allgather -> %d, expected MF_ERR_TIMEOUT: %s", (int)st,
                      mf_last_error());
    else if (ms > RDV_SHORT_TIMEOUT_MS + RDV_SLACK_MS)
        rc = mft_fail(__FILE__, __LINE__, "the failure took %.0f ms", ms);
    else if (!mft_contains_ci(mf_last_error(), "rank 2 did not send"))
        rc = mft_fail(__FILE__, __LINE__, "\"%s\" does not name rank 2", mf_last_error());
    bs.destroy(bs.ctx);
    return rc;
}

static int test_rank_stalls(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    rdv_proc_t procs[4] = {
        {0, 4, addr, 0, RDV_SHORT_TIMEOUT_MS, ROLE_NORMAL},
        {1, 4, addr, 0, 2000, ROLE_NORMAL},
        {2, 4, addr, 0, 2000, ROLE_LEAVE},
        {3, 4, addr, 0, 2000, ROLE_NORMAL},
    };
    return rdv_run(procs, 4, child_stall);
}

/* ROLE_LEAVE dies (a thread calls _exit) a few ms into a stream of 8 MiB allgathers, at whatever
 * point of the protocol it then is: the others' next or current allgather fails fast. */
static void *rdv_die_soon(void *arg) {
    (void)arg;
    rdv_sleep_ms(20);
    _exit(0);
}

static int child_dies_midway(const rdv_proc_t *p) {
    mf_bootstrap_t bs;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs));
    pthread_t killer;
    if (p->role == ROLE_LEAVE && pthread_create(&killer, NULL, rdv_die_soon, NULL) != 0)
        MFT_FAIL("pthread_create failed");
    const size_t bytes = 8u << 20;
    uint8_t *send = (uint8_t *)mft_alloc(bytes), *recv = (uint8_t *)mft_alloc(bytes * (size_t)p->num_ranks);
    memset(send, p->rank, bytes);
    int rc = 0, calls = 0;
    for (;; calls++) {
        double t0 = rdv_now_ms();
        int32_t st = bs.allgather(bs.ctx, send, recv, bytes);
        double ms = rdv_now_ms() - t0;
        if (st == 0) {
            if (calls < 10000) continue;
            rc = mft_fail(__FILE__, __LINE__, "10000 allgathers succeeded: nobody died");
            break;
        }
        mft_verbose("  rank %d: allgather %d -> %d after %.0f ms: %s\n", (int)p->rank, calls,
                    (int)st, ms, mf_last_error());
        if (st != MF_ERR_SYSTEM || ms > (double)p->timeout_ms / 2)
            rc = mft_fail(__FILE__, __LINE__, "allgather %d -> %d after %.0f ms: %s", calls, (int)st,
                          ms, mf_last_error());
        break;
    }
    free(send);
    free(recv);
    bs.destroy(bs.ctx);
    return rc;
}

static int test_rank_dies_midway(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    const int roles[3] = {ROLE_NORMAL, ROLE_NORMAL, ROLE_LEAVE};
    if (rdv_run_group(3, addr, RDV_TIMEOUT_MS, roles, child_dies_midway)) return 1;
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    const int roles0[3] = {ROLE_LEAVE, ROLE_NORMAL, ROLE_NORMAL}; /* rank 0 dies */
    return rdv_run_group(3, addr, RDV_TIMEOUT_MS, roles0, child_dies_midway);
}

/* One good allgather, then ROLE_BIG passes 4 MiB where the others pass 8 bytes: every rank
 * fails fast, naming the bytes; a later call fails too. */
static int child_mismatch(const rdv_proc_t *p) {
    mf_bootstrap_t bs;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs));
    const size_t big = 4u << 20;
    uint8_t *send = (uint8_t *)mft_alloc(big), *recv = (uint8_t *)mft_alloc(big * (size_t)p->num_ranks);
    int rc = 0;
    memset(send, p->rank, big);
    if (bs.allgather(bs.ctx, send, recv, 8) != 0)
        rc = mft_fail(__FILE__, __LINE__, "the first allgather failed: %s", mf_last_error());
    for (int32_t r = 0; r < p->num_ranks && !rc; r++)
        if (recv[(size_t)r * 8] != (uint8_t)r) rc = mft_fail(__FILE__, __LINE__, "block %d", (int)r);
    if (!rc) {
        double t0 = rdv_now_ms();
        int32_t st = bs.allgather(bs.ctx, send, recv, p->role == ROLE_BIG ? big : 8);
        double ms = rdv_now_ms() - t0;
        mft_verbose("  rank %d: %d after %.0f ms: %s\n", (int)p->rank, (int)st, ms, mf_last_error());
        if (st == 0) rc = mft_fail(__FILE__, __LINE__, "mismatched bytes: the allgather succeeded");
        else if (ms > (double)p->timeout_ms / 2)
            rc = mft_fail(__FILE__, __LINE__, "the failure took %.0f ms", ms);
        else if (!mft_contains_ci(mf_last_error(), "bytes"))
            rc = mft_fail(__FILE__, __LINE__, "\"%s\" does not name the bytes", mf_last_error());
        else if (bs.allgather(bs.ctx, send, recv, 8) == 0)
            rc = mft_fail(__FILE__, __LINE__, "a later allgather succeeded");
    }
    free(send);
    free(recv);
    bs.destroy(bs.ctx);
    return rc;
}

static int test_bytes_mismatch(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    const int roles[4] = {ROLE_NORMAL, ROLE_BIG, ROLE_NORMAL, ROLE_NORMAL};
    if (rdv_run_group(4, addr, RDV_TIMEOUT_MS, roles, child_mismatch)) return 1;
    /* Rank 0 is the odd one. */
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    const int roles0[3] = {ROLE_BIG, ROLE_NORMAL, ROLE_NORMAL};
    return rdv_run_group(3, addr, RDV_TIMEOUT_MS, roles0, child_mismatch);
}

/* ---- ranks that disagree, a busy address ---------------------------------------------------- */

/* Expects MF_ERR_INVALID_ARGUMENT, quickly, with *bootstrap untouched. */
static int child_expect_invalid(const rdv_proc_t *p) {
    mf_bootstrap_t bs, before;
    mft_poison(&before, sizeof before);
    memcpy(&bs, &before, sizeof bs);
    double t0 = rdv_now_ms();
    MFT_CHECK_ERR(mf_rendezvous_bootstrap(p->address, p->rank, p->num_ranks, p->timeout_ms, &bs),
                  MF_ERR_INVALID_ARGUMENT);
    double ms = rdv_now_ms() - t0;
    MFT_CHECK_MSG(ms < (double)p->timeout_ms / 2, "took %.0f ms", ms);
    MFT_CHECK(memcmp(&bs, &before, sizeof bs) == 0);
    return 0;
}

static int test_disagree(void) {
    char a[MF_ADDRESS_BYTES], b[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(a));
    MFT_CHECK_OK(mf_rendezvous_address(b));
    /* Two processes given rank 1 (and nobody rank 2). */
    rdv_proc_t twice[3] = {
        {0, 3, a, 0, RDV_TIMEOUT_MS, 0}, {1, 3, a, 0, RDV_TIMEOUT_MS, 0},
        {1, 3, a, 1, RDV_TIMEOUT_MS, 0},
    };
    if (rdv_run(twice, 3, child_expect_invalid)) return 1;
    /* Rank 1 believes in 3 ranks, rank 0 in 2. */
    rdv_proc_t sizes[2] = {{0, 2, b, 0, RDV_TIMEOUT_MS, 0}, {1, 3, b, 0, RDV_TIMEOUT_MS, 0}};
    return rdv_run(sizes, 2, child_expect_invalid);
}

/* Two processes both claim rank 0 of one address: the second cannot bind. */
static int child_busy(const rdv_proc_t *p) {
    mf_bootstrap_t bs;
    if (p->role == 0) { /* binds first, then nobody comes */
        MFT_CHECK_ERR(mf_rendezvous_bootstrap(p->address, 0, 2, p->timeout_ms, &bs), MF_ERR_TIMEOUT);
        return 0;
    }
    rdv_sleep_ms(150);
    double t0 = rdv_now_ms();
    MFT_CHECK_ERR(mf_rendezvous_bootstrap(p->address, 0, 2, p->timeout_ms, &bs), MF_ERR_SYSTEM);
    MFT_CHECK_MSG(rdv_now_ms() - t0 < 100, "took %.0f ms", rdv_now_ms() - t0);
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), "in use"), "%s", mf_last_error());
    return 0;
}

static int test_address_in_use(void) {
    char addr[MF_ADDRESS_BYTES];
    MFT_CHECK_OK(mf_rendezvous_address(addr));
    rdv_proc_t procs[2] = {{0, 2, addr, 0, RDV_SHORT_TIMEOUT_MS, 0},
                           {0, 2, addr, 1, RDV_SHORT_TIMEOUT_MS, 1}};
    return rdv_run(procs, 2, child_busy);
}

const mft_test_t mft_tests_rendezvous[] = {
    {"rendezvous_address", test_address, 10},
    {"rendezvous_args", test_args, 10},
    {"rendezvous_single", test_single, 10},
    {"rendezvous_allgather_1", test_allgather_1, 30},
    {"rendezvous_allgather_2", test_allgather_2, 30},
    {"rendezvous_allgather_4", test_allgather_4, 30},
    {"rendezvous_allgather_8", test_allgather_8, 30},
    {"rendezvous_late_root", test_late_root, 30},
    {"rendezvous_two_groups", test_two_groups, 30},
    {"rendezvous_missing_rank", test_missing_rank, 30},
    {"rendezvous_missing_root", test_missing_root, 30},
    {"rendezvous_skew_listener_last", test_skew_listener_last, 60},
    {"rendezvous_skew_random", test_skew_random, 60},
    {"rendezvous_silent_root", test_silent_root, 30},
    {"rendezvous_rank_leaves", test_rank_leaves, 30},
    {"rendezvous_root_leaves", test_root_leaves, 30},
    {"rendezvous_rank_stalls", test_rank_stalls, 30},
    {"rendezvous_rank_dies_midway", test_rank_dies_midway, 30},
    {"rendezvous_bytes_mismatch", test_bytes_mismatch, 30},
    {"rendezvous_disagree", test_disagree, 30},
    {"rendezvous_address_in_use", test_address_in_use, 30},
    {NULL, NULL, 0},
};
