/*
 * rendezvous.c — the built-in bootstrap (mf_rendezvous_address, mf_rendezvous_bootstrap): ranks
 * that are processes of one host meet at a Linux abstract Unix socket and get an allgather over
 * it, for tools and tests (an engine passes its own allgather to mf_comm_init).
 *
 * Topology: a star through rank 0. Rank 0 binds and listens at the address, accepts the R - 1
 * other ranks and closes the listening socket once all have arrived; every other rank connects
 * (retrying until its deadline, since rank 0 may start later) and keeps its one connection to
 * rank 0. Nothing touches the filesystem: an abstract name vanishes with its socket.
 *
 * Messages: one fixed struct, mf__rdv_msg_t, in native byte order (every rank is on this host).
 *   HELLO    rank r -> 0   r, its R and when its timeout ends; rank 0 checks the range, that R
 *                          agrees, and duplicates
 *   WELCOME  0 -> rank r   MF_SUCCESS once every rank has arrived, else the failure's code and a
 *                          note (which ranks did not arrive, who disagreed): the call is collective
 *   BLOCK    rank r -> 0   the allgather's sequence number and `bytes`, then r's block
 *   RESULT   0 -> rank r   MF_SUCCESS, sequence and bytes, then the R * bytes result; or a failure
 *                          code and a note saying what rank 0 saw (a rank left, timed out, or
 *                          passed other bytes)
 * Rank 0 copies its own block, reads every other rank's block (poll over all connections; blocks
 * land in place in recv), checks that sequence and bytes agree, then writes the result to every
 * rank, again multiplexed over all connections.
 *
 * One verdict for all (issue 26): ranks start at different times, each with its own timeout, yet
 * every rank that arrived must learn the same outcome, naming the ranks that did not arrive. So
 * rank 0 decides: it waits until every rank has arrived or until the earliest timeout among its
 * own and those of the ranks that arrived (each HELLO says how long its sender still waits), and
 * then tells every connected rank. A rank other than 0 waits for that verdict up to
 * MF__RDV_VERDICT_GRACE_MS past its own timeout (the verdict is due at it, plus the time rank 0
 * took to read the HELLO), so that only a rank 0 that hangs leaves it without one.
 *
 * Only processes of this user take part (SO_PEERCRED on both ends): an abstract address is open
 * to every user of the host, and rank 0 drops the connections of others unread.
 *
 * Every socket is non-blocking and close-on-exec; every wait is a poll() bounded by the
 * bootstrap's timeout, counted from the start of the call (the wait for rank 0's verdict: that
 * plus MF__RDV_VERDICT_GRACE_MS); sends use MSG_NOSIGNAL. A peer that
 * died is an error (EOF, EPIPE, ECONNRESET), never a signal or a hang. A failure is sticky: the
 * rank records its description in the context and in mf_last_error(), rank 0 tells the ranks
 * that are between messages, every connection is closed (so peers see EOF rather than wait), and
 * every later allgather fails at once with the same description. The allgather returns 0 or the
 * failure's mf_result_t. One call at a time per bootstrap (it is not thread-safe).
 */
#define _GNU_SOURCE /* SOCK_CLOEXEC, SOCK_NONBLOCK, accept4, getrandom, struct ucred */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/params.h"
#include "transport/transport.h"

#define MF__RDV_PREFIX "unix:"
#define MF__RDV_PREFIX_LEN 5
#define MF__RDV_MAGIC 0x6d667276u        /* "mfrv" */
#define MF__RDV_VERSION 2u               /* of the messages below */
#define MF__RDV_NOTE_BYTES 200           /* a failure's description, carried by WELCOME/RESULT */
#define MF__RDV_ERROR_BYTES 384          /* the context's copy: a prefix and the note */
#define MF__RDV_RETRY_MS 5               /* between a rank's attempts to connect to rank 0 */
#define MF__RDV_VERDICT_GRACE_MS 1000    /* how long past its own timeout a rank waits for rank 0's
                                            verdict (rank 0 gives it at that timeout at the latest) */
#define MF__RDV_MAX_PENDING MF_MAX_RANKS /* accepted connections whose HELLO is incomplete */
#define MF__RDV_MAX_TIMEOUT_MS ((int64_t)1 << 40) /* longer timeouts are this (35 years) */

enum { MF__RDV_HELLO = 1, MF__RDV_WELCOME = 2, MF__RDV_BLOCK = 3, MF__RDV_RESULT = 4 };

typedef struct mf__rdv_msg {
    uint32_t magic;     /* MF__RDV_MAGIC */
    uint32_t kind;      /* MF__RDV_HELLO .. MF__RDV_RESULT */
    uint32_t version;   /* MF__RDV_VERSION */
    int32_t rank;       /* HELLO: the sender's rank */
    int32_t num_ranks;  /* HELLO: the sender's R */
    int32_t status;     /* WELCOME, RESULT: MF_SUCCESS or the failure's mf_result_t */
    int64_t wait_ms;    /* HELLO: how long from now the sender's timeout runs on */
    int64_t timeout_ms; /* HELLO: the sender's timeout */
    uint64_t sequence;  /* BLOCK, RESULT: allgathers completed before this one */
    uint64_t bytes;     /* BLOCK, RESULT: bytes per rank */
    char note[MF__RDV_NOTE_BYTES]; /* with a failure status: what failed, as rank 0 saw it */
} mf__rdv_msg_t;

/* The bootstrap's ctx. */
typedef struct mf__rdv {
    int32_t rank, num_ranks;
    int64_t timeout_ms;              /* resolved: every wait of one call is bounded by it */
    uint64_t sequence;               /* allgathers completed */
    int fd[MF_MAX_RANKS];            /* rank 0: fd[r] = rank r's connection, fd[0] = -1;
                                        other ranks: fd[0] = the connection to rank 0; else -1 */
    mf_result_t failure;             /* MF_SUCCESS, or the failure that made it unusable */
    char error[MF__RDV_ERROR_BYTES]; /* that failure's description */
} mf__rdv_t;

/* ---- time and small helpers ------------------------------------------------------------------- */

static int64_t mf__rdv_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Milliseconds left until `deadline`, as a poll() timeout; 0 when it has passed. */
static int mf__rdv_left_ms(int64_t deadline) {
    int64_t left = deadline - mf__rdv_now_ms();
    if (left <= 0) return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

/* The user id of the process at the other end of a connected Unix socket, or -1. Only processes
 * of this user may take part: an abstract address is open to every user of the host. */
static long mf__rdv_peer_uid(int fd) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return -1;
    return (long)cred.uid;
}

static void mf__rdv_close(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static const char *mf__rdv_plural(uint64_t mask) { return (mask & (mask - 1)) ? "s" : ""; }

/* Writes the ranks set in `mask` as "1, 3, 7" (cut short with "..." when it does not fit). */
static void mf__rdv_rank_list(uint64_t mask, char *out, size_t size) {
    size_t at = 0;
    out[0] = '\0';
    for (int32_t r = 0; r < MF_MAX_RANKS; r++) {
        if (!(mask & ((uint64_t)1 << r))) continue;
        int n = snprintf(out + at, size - at, "%s%d", at ? ", " : "", (int)r);
        if (n < 0 || (size_t)n >= size - at) {
            if (size >= 4) strcpy(out + size - 4, "...");
            return;
        }
        at += (size_t)n;
    }
}

static mf_result_t mf__rdv_status_code(int32_t status) {
    return (status > MF_SUCCESS && status <= MF_ERR_ABORTED) ? (mf_result_t)status : MF_ERR_SYSTEM;
}

static void mf__rdv_msg_init(mf__rdv_msg_t *m, uint32_t kind) {
    memset(m, 0, sizeof *m);
    m->magic = MF__RDV_MAGIC;
    m->kind = kind;
    m->version = MF__RDV_VERSION;
}

static int mf__rdv_msg_ok(const mf__rdv_msg_t *m, uint32_t kind) {
    return m->magic == MF__RDV_MAGIC && m->kind == kind && m->version == MF__RDV_VERSION;
}

/* ---- non-blocking transfers ------------------------------------------------------------------- */

enum { MF__IO_AGAIN = 0, MF__IO_DONE = 1, MF__IO_CLOSED = 2, MF__IO_ERROR = 3, MF__IO_TIMEOUT = 4 };

/* One direction of one connection: a message, then a payload (the payload of a received message
 * is set once its message has been read and checked). */
typedef struct mf__rdv_xfer {
    char *head;
    size_t head_len;
    char *body;
    size_t body_len;
    size_t done; /* bytes moved: of head, then of body */
} mf__rdv_xfer_t;

static void mf__rdv_xfer_init(mf__rdv_xfer_t *x, void *head, size_t head_len, const void *body,
                              size_t body_len) {
    x->head = (char *)head;
    x->head_len = head_len;
    x->body = (char *)body; /* only read from when sending */
    x->body_len = body_len;
    x->done = 0;
}

static int mf__rdv_xfer_complete(const mf__rdv_xfer_t *x) {
    return x->done == x->head_len + x->body_len;
}

/* Moves as much of x as the socket takes (sending) or holds (receiving) now. MF__IO_CLOSED: the
 * peer closed its end or reset it; MF__IO_ERROR: another failure, in errno. */
static int mf__rdv_xfer_step(int fd, mf__rdv_xfer_t *x, int sending) {
    while (!mf__rdv_xfer_complete(x)) {
        int in_head = x->done < x->head_len;
        char *p = in_head ? x->head + x->done : x->body + (x->done - x->head_len);
        size_t left = in_head ? x->head_len - x->done : x->head_len + x->body_len - x->done;
        ssize_t n = sending ? send(fd, p, left, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recv(fd, p, left, MSG_DONTWAIT);
        if (n > 0) {
            x->done += (size_t)n;
            continue;
        }
        if (n == 0) return MF__IO_CLOSED; /* recv: end of stream */
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return MF__IO_AGAIN;
        if (errno == EPIPE || errno == ECONNRESET) return MF__IO_CLOSED;
        return MF__IO_ERROR;
    }
    return MF__IO_DONE;
}

/* Moves all of x over one connection, waiting at most until `deadline`. */
static int mf__rdv_xfer_wait(int fd, mf__rdv_xfer_t *x, int sending, int64_t deadline) {
    for (;;) {
        int st = mf__rdv_xfer_step(fd, x, sending);
        if (st != MF__IO_AGAIN) return st;
        int left = mf__rdv_left_ms(deadline);
        if (left == 0) return MF__IO_TIMEOUT;
        struct pollfd p = {fd, (short)(sending ? POLLOUT : POLLIN), 0};
        if (poll(&p, 1, left) < 0 && errno != EINTR) return MF__IO_ERROR;
    }
}

/* Sends one message now if the socket takes it whole, ignoring failures: telling a peer about a
 * failure is a courtesy, the closed connection that follows is the guarantee. */
static void mf__rdv_send_best_effort(int fd, const mf__rdv_msg_t *m) {
    if (fd >= 0) {
        ssize_t n;
        do n = send(fd, m, sizeof *m, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
    }
}

/* ---- addresses -------------------------------------------------------------------------------- */

mf_result_t mf_rendezvous_address(char address[MF_ADDRESS_BYTES]) {
    static _Atomic uint32_t counter;
    MF_REQUIRE(address != NULL, "mf_rendezvous_address: address is NULL");
    uint64_t entropy = 0;
    ssize_t got;
    do got = getrandom(&entropy, sizeof entropy, GRND_NONBLOCK);
    while (got < 0 && errno == EINTR);
    if (got != (ssize_t)sizeof entropy) {
        int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (read(fd, &entropy, sizeof entropy) != (ssize_t)sizeof entropy) entropy = 0;
            close(fd);
        }
    }
    /* Mixed with the clock (splitmix64's finaliser), in case neither source answered; the pid
     * and the counter keep addresses of live processes unique regardless. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t z = entropy ^ ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    snprintf(address, MF_ADDRESS_BYTES, MF__RDV_PREFIX "moeflow-%ld-%u-%016llx", (long)getpid(),
             (unsigned)atomic_fetch_add(&counter, 1u), (unsigned long long)z);
    return MF_SUCCESS;
}

/* "unix:NAME" -> the abstract socket address of NAME (sun_path[0] = '\0', then NAME). */
static mf_result_t mf__rdv_parse(const char *address, struct sockaddr_un *sa, socklen_t *sa_len) {
    size_t n = strnlen(address, MF_ADDRESS_BYTES);
    MF_REQUIRE(n < MF_ADDRESS_BYTES, "mf_rendezvous_bootstrap: address is not a string of fewer "
               "than MF_ADDRESS_BYTES (%d) bytes", MF_ADDRESS_BYTES);
    MF_REQUIRE(strncmp(address, MF__RDV_PREFIX, MF__RDV_PREFIX_LEN) == 0,
               "mf_rendezvous_bootstrap: address \"%s\" does not start with \"" MF__RDV_PREFIX "\"",
               address);
    size_t name_len = n - MF__RDV_PREFIX_LEN;
    MF_REQUIRE(name_len >= 1 && name_len < sizeof sa->sun_path,
               "mf_rendezvous_bootstrap: address \"%s\": the name after \"" MF__RDV_PREFIX
               "\" must have 1 to %zu bytes", address, sizeof sa->sun_path - 1);
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    memcpy(sa->sun_path + 1, address + MF__RDV_PREFIX_LEN, name_len);
    *sa_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + name_len);
    return MF_SUCCESS;
}

/* ---- the rendezvous: rank 0 ------------------------------------------------------------------- */

/* A failed rendezvous: tells every connected rank the failure `code` and `note` (a WELCOME with
 * that status), then closes their connections. `extra_fd`, when >= 0, is a connection not (yet) in c->fd
 * that is told too (the rank whose HELLO made it fail). */
static void mf__rdv_root_refuse(mf__rdv_t *c, mf_result_t code, const char *note, int extra_fd) {
    mf__rdv_msg_t m;
    mf__rdv_msg_init(&m, MF__RDV_WELCOME);
    m.status = (int32_t)code;
    snprintf(m.note, sizeof m.note, "%s", note);
    mf__rdv_send_best_effort(extra_fd, &m);
    for (int32_t r = 1; r < c->num_ranks; r++) {
        mf__rdv_send_best_effort(c->fd[r], &m);
        mf__rdv_close(&c->fd[r]);
    }
}

typedef struct mf__rdv_pending {
    int fd;
    mf__rdv_msg_t hello;
    mf__rdv_xfer_t x;
} mf__rdv_pending_t;

/* When rank 0 gives its verdict: the earliest end of a timeout among rank 0's and those of the
 * ranks that arrived, and whose timeout that is. */
typedef struct mf__rdv_verdict {
    int64_t at;
    int32_t rank;
    int64_t timeout_ms;
} mf__rdv_verdict_t;

/* Checks one complete HELLO; on success moves its connection into c->fd and brings the verdict
 * forward to its sender's timeout where that ends first. Returns MF_SUCCESS, or a failure with
 * `note` filled; a stranger (bad magic) is dropped with MF_SUCCESS. */
static mf_result_t mf__rdv_root_hello(mf__rdv_t *c, mf__rdv_pending_t *p, uint64_t *arrived,
                                      mf__rdv_verdict_t *verdict, char *note, size_t note_size) {
    const mf__rdv_msg_t *h = &p->hello;
    if (!mf__rdv_msg_ok(h, MF__RDV_HELLO)) { /* not one of ours (or another moeflow version) */
        mf__rdv_close(&p->fd);
        return MF_SUCCESS;
    }
    if (h->num_ranks != c->num_ranks) {
        snprintf(note, note_size, "rank %d was called with num_ranks = %d, rank 0 with %d",
                 (int)h->rank, (int)h->num_ranks, (int)c->num_ranks);
        return MF_ERR_INVALID_ARGUMENT;
    }
    if (h->rank < 1 || h->rank >= c->num_ranks || (*arrived & ((uint64_t)1 << h->rank))) {
        snprintf(note, note_size, "rank %d joined twice (two processes were given rank %d)",
                 (int)h->rank, (int)h->rank);
        return MF_ERR_INVALID_ARGUMENT;
    }
    c->fd[h->rank] = p->fd;
    p->fd = -1;
    *arrived |= (uint64_t)1 << h->rank;
    int64_t wait = h->wait_ms < 0 ? 0 : h->wait_ms > MF__RDV_MAX_TIMEOUT_MS ? MF__RDV_MAX_TIMEOUT_MS
                                                                          : h->wait_ms;
    int64_t at = mf__rdv_now_ms() + wait;
    if (at < verdict->at) *verdict = (mf__rdv_verdict_t){at, h->rank, h->timeout_ms};
    return MF_SUCCESS;
}

/* The accept loop: until every rank's HELLO has arrived and checked, or the verdict falls due
 * (rank 0's deadline, or an earlier one of a rank that arrived). */
static mf_result_t mf__rdv_root_accept(mf__rdv_t *c, int lfd, const char *address,
                                       int64_t deadline, char *note, size_t note_size) {
    const uint64_t all = c->num_ranks == 64 ? ~(uint64_t)0 : ((uint64_t)1 << c->num_ranks) - 1;
    uint64_t arrived = 1; /* rank 0 */
    mf__rdv_verdict_t verdict = {deadline, 0, c->timeout_ms};
    mf__rdv_pending_t pending[MF__RDV_MAX_PENDING];
    int32_t num_pending = 0;
    mf_result_t res = MF_SUCCESS;
    int bad_fd = -1; /* the connection whose HELLO made the rendezvous fail */

    while (arrived != all && res == MF_SUCCESS) {
        int left = mf__rdv_left_ms(verdict.at);
        if (left == 0) {
            char missing[160];
            mf__rdv_rank_list(all & ~arrived, missing, sizeof missing);
            /* Bounded fields: the note holds them whatever the list and the address. */
            snprintf(note, note_size, "rank%s %.80s of %d did not arrive at %.40s within %lld ms "
                     "(rank %d's timeout)", mf__rdv_plural(all & ~arrived), missing,
                     (int)c->num_ranks, address, (long long)verdict.timeout_ms, (int)verdict.rank);
            res = MF_ERR_TIMEOUT;
            break;
        }
        struct pollfd pfd[1 + MF__RDV_MAX_PENDING];
        pfd[0] = (struct pollfd){lfd, POLLIN, 0};
        for (int32_t i = 0; i < num_pending; i++) pfd[1 + i] = (struct pollfd){pending[i].fd, POLLIN, 0};
        if (poll(pfd, (nfds_t)(1 + num_pending), left) < 0) {
            if (errno == EINTR) continue;
            snprintf(note, note_size, "poll: %s", strerror(errno));
            res = MF_ERR_SYSTEM;
            break;
        }
        /* HELLOs of connections accepted earlier (pfd[1..] still matches pending[]). */
        for (int32_t i = 0; i < num_pending && res == MF_SUCCESS; i++) {
            if (!pfd[1 + i].revents) continue;
            mf__rdv_pending_t *p = &pending[i];
            int st = mf__rdv_xfer_step(p->fd, &p->x, 0);
            if (st == MF__IO_CLOSED || st == MF__IO_ERROR) mf__rdv_close(&p->fd); /* left early */
            else if (st == MF__IO_DONE) {
                res = mf__rdv_root_hello(c, p, &arrived, &verdict, note, note_size);
                if (res != MF_SUCCESS) {
                    bad_fd = p->fd;
                    p->fd = -1;
                }
            }
        }
        /* Drop the finished (moved, closed) entries. */
        int32_t kept = 0;
        for (int32_t i = 0; i < num_pending; i++) {
            if (pending[i].fd < 0) continue;
            if (kept != i) {
                pending[kept] = pending[i];
                pending[kept].x.head = (char *)&pending[kept].hello; /* the copy's own buffer */
            }
            kept++;
        }
        num_pending = kept;
        if (res != MF_SUCCESS || !(pfd[0].revents & POLLIN)) continue;
        /* New connections. */
        for (;;) {
            int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) {
                if (errno == EINTR || errno == ECONNABORTED) continue;
                if (errno == EAGAIN || errno == EWOULDBLOCK) break;
                snprintf(note, note_size, "accept at %s: %s", address, strerror(errno));
                res = MF_ERR_SYSTEM;
                break;
            }
            if (num_pending == MF__RDV_MAX_PENDING || mf__rdv_peer_uid(fd) != (long)geteuid()) {
                close(fd); /* another user's process; or a flood, which only strangers make */
                continue;
            }
            mf__rdv_pending_t *p = &pending[num_pending++];
            p->fd = fd;
            mf__rdv_xfer_init(&p->x, &p->hello, sizeof p->hello, NULL, 0);
        }
    }

    if (res != MF_SUCCESS) mf__rdv_root_refuse(c, res, note, bad_fd);
    if (bad_fd >= 0) close(bad_fd);
    for (int32_t i = 0; i < num_pending; i++) mf__rdv_close(&pending[i].fd);
    return res;
}

static mf_result_t mf__rdv_root(mf__rdv_t *c, const struct sockaddr_un *sa, socklen_t sa_len,
                                const char *address, int64_t deadline) {
    char note[MF__RDV_NOTE_BYTES];
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0)
        return mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank 0: socket: %s", strerror(errno));
    if (bind(lfd, (const struct sockaddr *)sa, sa_len) != 0) {
        int e = errno;
        close(lfd);
        return mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank 0: bind to %s: %s%s", address,
                         strerror(e), e == EADDRINUSE ? " (another rendezvous uses this address)" : "");
    }
    int backlog = c->num_ranks < SOMAXCONN ? c->num_ranks : SOMAXCONN;
    if (listen(lfd, backlog) != 0) {
        int e = errno;
        close(lfd);
        return mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank 0: listen at %s: %s", address,
                         strerror(e));
    }
    mf_result_t res = mf__rdv_root_accept(c, lfd, address, deadline, note, sizeof note);
    close(lfd); /* the address is free again from here */
    if (res != MF_SUCCESS)
        return mf__error(res, "mf_rendezvous_bootstrap: rank 0 of %d: %s", (int)c->num_ranks, note);

    /* Everyone is here: welcome them (a rank that left meanwhile fails the rendezvous). */
    mf__rdv_msg_t m;
    mf__rdv_msg_init(&m, MF__RDV_WELCOME);
    m.status = MF_SUCCESS;
    for (int32_t r = 1; r < c->num_ranks; r++) {
        mf__rdv_xfer_t x;
        mf__rdv_xfer_init(&x, &m, sizeof m, NULL, 0);
        int st = mf__rdv_xfer_wait(c->fd[r], &x, 1, deadline);
        if (st == MF__IO_DONE) continue;
        res = st == MF__IO_TIMEOUT ? MF_ERR_TIMEOUT : MF_ERR_SYSTEM;
        snprintf(note, sizeof note, "rank %d %s", (int)r,
                 st == MF__IO_TIMEOUT ? "did not take its welcome in time"
                                      : "closed its connection during the rendezvous");
        mf__rdv_root_refuse(c, res, note, -1);
        return mf__error(res, "mf_rendezvous_bootstrap: rank 0 of %d: %s", (int)c->num_ranks, note);
    }
    return MF_SUCCESS;
}

/* ---- the rendezvous: ranks 1 .. R-1 ----------------------------------------------------------- */

/* Connects to rank 0, retrying while nobody listens yet (ECONNREFUSED) or its backlog is full
 * (EAGAIN). Returns the connected socket, or -1 with the error recorded. */
static int mf__rdv_connect(const mf__rdv_t *c, const struct sockaddr_un *sa, socklen_t sa_len,
                           const char *address, int64_t deadline, mf_result_t *res) {
    for (;;) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            *res = mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank %d: socket: %s",
                             (int)c->rank, strerror(errno));
            return -1;
        }
        int e = 0;
        if (connect(fd, (const struct sockaddr *)sa, sa_len) != 0) {
            e = errno;
            if (e == EINPROGRESS) { /* not what AF_UNIX does, but allowed: wait for the outcome */
                struct pollfd p = {fd, POLLOUT, 0};
                socklen_t len = sizeof e;
                if (poll(&p, 1, mf__rdv_left_ms(deadline)) <= 0) e = ETIMEDOUT;
                else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
            }
        }
        if (e == 0) return fd;
        close(fd);
        if (e != ECONNREFUSED && e != ENOENT && e != EAGAIN && e != EINTR && e != ETIMEDOUT) {
            *res = mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank %d: connect to %s: %s",
                             (int)c->rank, address, strerror(e));
            return -1;
        }
        int left = mf__rdv_left_ms(deadline);
        if (left == 0) {
            *res = mf__error(MF_ERR_TIMEOUT, "mf_rendezvous_bootstrap: rank %d of %d: rank 0 was "
                             "not listening at %s within %lld ms", (int)c->rank,
                             (int)c->num_ranks, address, (long long)c->timeout_ms);
            return -1;
        }
        int sleep_ms = left < MF__RDV_RETRY_MS ? left : MF__RDV_RETRY_MS;
        struct timespec ts = {0, (long)sleep_ms * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static mf_result_t mf__rdv_join(mf__rdv_t *c, const struct sockaddr_un *sa, socklen_t sa_len,
                                const char *address, int64_t deadline) {
    mf_result_t res = MF_SUCCESS;
    int fd = mf__rdv_connect(c, sa, sa_len, address, deadline, &res);
    if (fd < 0) return res;
    long uid = mf__rdv_peer_uid(fd);
    if (uid != (long)geteuid()) {
        close(fd);
        return mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank %d of %d: the process "
                         "listening at %s belongs to user %ld, not to this one (%ld)", (int)c->rank,
                         (int)c->num_ranks, address, uid, (long)geteuid());
    }

    mf__rdv_msg_t m;
    mf__rdv_msg_init(&m, MF__RDV_HELLO);
    m.rank = c->rank;
    m.num_ranks = c->num_ranks;
    m.wait_ms = deadline - mf__rdv_now_ms();
    m.timeout_ms = c->timeout_ms;
    mf__rdv_xfer_t x;
    mf__rdv_xfer_init(&x, &m, sizeof m, NULL, 0);
    int st = mf__rdv_xfer_wait(fd, &x, 1, deadline);
    if (st == MF__IO_DONE) { /* now the verdict, into m: due by this rank's deadline */
        mf__rdv_xfer_init(&x, &m, sizeof m, NULL, 0);
        st = mf__rdv_xfer_wait(fd, &x, 0, deadline + MF__RDV_VERDICT_GRACE_MS);
    }
    if (st == MF__IO_DONE && !mf__rdv_msg_ok(&m, MF__RDV_WELCOME)) {
        res = mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank %d of %d: protocol error: "
                        "what listens at %s is not a moeflow rank 0 (of this version)", (int)c->rank,
                        (int)c->num_ranks, address);
    } else if (st == MF__IO_DONE && m.status != MF_SUCCESS) {
        m.note[sizeof m.note - 1] = '\0';
        res = mf__error(mf__rdv_status_code(m.status), "mf_rendezvous_bootstrap: rank %d of %d: "
                        "rank 0 reports: %s", (int)c->rank, (int)c->num_ranks, m.note);
    } else if (st == MF__IO_TIMEOUT) {
        res = mf__error(MF_ERR_TIMEOUT, "mf_rendezvous_bootstrap: rank %d of %d: connected, but rank "
                        "0 gave no verdict within %lld ms (this rank's timeout + %d ms): is rank 0 "
                        "stuck?", (int)c->rank, (int)c->num_ranks, (long long)c->timeout_ms,
                        MF__RDV_VERDICT_GRACE_MS);
    } else if (st == MF__IO_CLOSED) {
        res = mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank %d of %d: rank 0 closed the "
                        "connection during the rendezvous", (int)c->rank, (int)c->num_ranks);
    } else if (st != MF__IO_DONE) {
        res = mf__error(MF_ERR_SYSTEM, "mf_rendezvous_bootstrap: rank %d of %d: talking to rank 0: %s",
                        (int)c->rank, (int)c->num_ranks, strerror(errno));
    }
    if (res != MF_SUCCESS) {
        close(fd);
        return res;
    }
    c->fd[0] = fd;
    return MF_SUCCESS;
}

/* ---- the allgather ---------------------------------------------------------------------------- */

/* Makes the bootstrap unusable: records "<prefix>: <note>" as the context's and this thread's last
 * error, tells the ranks in `notify` (rank 0 only: those between messages) with a failed RESULT,
 * and closes every connection. Returns `code`. */
static mf_result_t mf__rdv_fail(mf__rdv_t *c, mf_result_t code, uint64_t notify, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

static mf_result_t mf__rdv_fail(mf__rdv_t *c, mf_result_t code, uint64_t notify, const char *fmt, ...) {
    mf__rdv_msg_t m;
    mf__rdv_msg_init(&m, MF__RDV_RESULT);
    m.status = (int32_t)code;
    m.sequence = c->sequence;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m.note, sizeof m.note, fmt, ap);
    va_end(ap);
    snprintf(c->error, sizeof c->error, "rendezvous allgather #%llu, rank %d of %d: %s",
             (unsigned long long)c->sequence, (int)c->rank, (int)c->num_ranks, m.note);
    c->failure = code;
    for (int32_t r = 0; r < c->num_ranks; r++) {
        if (notify & ((uint64_t)1 << r)) mf__rdv_send_best_effort(c->fd[r], &m);
        mf__rdv_close(&c->fd[r]);
    }
    return mf__error(code, "%s", c->error);
}

/* Rank 0: polls the connections of the ranks in `waiting` (rank 0 never is) for `events`, at most
 * `left` ms, and sets *ready to the ranks whose connection is ready (0 when a signal interrupted the
 * poll). Returns 0, or -1 with errno when poll failed. */
static int mf__rdv_poll_ranks(const mf__rdv_t *c, uint64_t waiting, short events, int left, uint64_t *ready) {
    struct pollfd pfd[MF_MAX_RANKS];
    int32_t who[MF_MAX_RANKS];
    nfds_t n = 0;
    *ready = 0;
    for (int32_t r = 1; r < c->num_ranks; r++)
        if (waiting & ((uint64_t)1 << r)) {
            pfd[n] = (struct pollfd){c->fd[r], events, 0};
            who[n++] = r;
        }
    if (poll(pfd, n, left) < 0) return errno == EINTR ? 0 : -1;
    for (nfds_t i = 0; i < n; i++)
        if (pfd[i].revents) *ready |= (uint64_t)1 << who[i];
    return 0;
}

/* Rank 0: gathers every rank's block into recv, then writes the result to every rank. */
static mf_result_t mf__rdv_gather_root(mf__rdv_t *c, const void *send, char *recv, size_t bytes,
                                       int64_t deadline) {
    const int32_t R = c->num_ranks;
    const uint64_t peers = (R == 64 ? ~(uint64_t)0 : ((uint64_t)1 << R) - 1) & ~(uint64_t)1;
    mf__rdv_msg_t in[MF_MAX_RANKS], out;
    mf__rdv_xfer_t x[MF_MAX_RANKS];
    char list[160];

    if (bytes) memmove(recv, send, bytes); /* rank 0's own block; send may be recv itself */
    for (int32_t r = 1; r < R; r++) mf__rdv_xfer_init(&x[r], &in[r], sizeof in[r], NULL, 0);

    /* Phase 1: every rank's BLOCK message and block. */
    uint64_t waiting = peers, checked = 0; /* checked: ranks whose BLOCK message agreed */
    while (waiting) {
        int left = mf__rdv_left_ms(deadline);
        if (left == 0) {
            mf__rdv_rank_list(waiting, list, sizeof list);
            return mf__rdv_fail(c, MF_ERR_TIMEOUT, peers, "rank%s %s did not send %s block within "
                                "%lld ms", mf__rdv_plural(waiting), list,
                                (waiting & (waiting - 1)) ? "their" : "its", (long long)c->timeout_ms);
        }
        uint64_t ready = 0;
        if (mf__rdv_poll_ranks(c, waiting, POLLIN, left, &ready) < 0)
            return mf__rdv_fail(c, MF_ERR_SYSTEM, peers, "poll: %s", strerror(errno));
        for (int32_t r = 1; r < R; r++) {
            if (!(ready & ((uint64_t)1 << r))) continue;
            for (;;) {
                int st = mf__rdv_xfer_step(c->fd[r], &x[r], 0);
                if (st == MF__IO_AGAIN) break;
                if (st == MF__IO_CLOSED)
                    return mf__rdv_fail(c, MF_ERR_SYSTEM, peers, "rank %d closed its connection "
                                        "(it exited or failed)", (int)r);
                if (st == MF__IO_ERROR)
                    return mf__rdv_fail(c, MF_ERR_SYSTEM, peers, "recv from rank %d: %s", (int)r,
                                        strerror(errno));
                if (!(checked & ((uint64_t)1 << r))) { /* its message is in: check it */
                    if (!mf__rdv_msg_ok(&in[r], MF__RDV_BLOCK) || in[r].rank != r)
                        return mf__rdv_fail(c, MF_ERR_SYSTEM, peers, "protocol error: rank %d sent "
                                            "no BLOCK message", (int)r);
                    if (in[r].sequence != c->sequence)
                        return mf__rdv_fail(c, MF_ERR_INVALID_USAGE, peers, "rank %d is at "
                                            "allgather #%llu, rank 0 at #%llu", (int)r,
                                            (unsigned long long)in[r].sequence,
                                            (unsigned long long)c->sequence);
                    if (in[r].bytes != (uint64_t)bytes)
                        return mf__rdv_fail(c, MF_ERR_INVALID_ARGUMENT, peers, "bytes differ: "
                                            "rank %d passed %llu bytes, rank 0 passed %zu", (int)r,
                                            (unsigned long long)in[r].bytes, bytes);
                    checked |= (uint64_t)1 << r;
                    x[r].body = bytes ? recv + (size_t)r * bytes : NULL;
                    x[r].body_len = bytes;
                    continue;
                }
                waiting &= ~((uint64_t)1 << r); /* st == MF__IO_DONE with its block */
                break;
            }
        }
    }

    /* Phase 2: the result to every rank. */
    mf__rdv_msg_init(&out, MF__RDV_RESULT);
    out.status = MF_SUCCESS;
    out.sequence = c->sequence;
    out.bytes = bytes;
    for (int32_t r = 1; r < R; r++) mf__rdv_xfer_init(&x[r], &out, sizeof out, recv, (size_t)R * bytes);
    waiting = peers;
    while (waiting) {
        uint64_t untouched = 0; /* ranks that got none of it yet can still be told of a failure */
        for (int32_t r = 1; r < R; r++)
            if ((waiting & ((uint64_t)1 << r)) && x[r].done == 0) untouched |= (uint64_t)1 << r;
        int left = mf__rdv_left_ms(deadline);
        if (left == 0) {
            mf__rdv_rank_list(waiting, list, sizeof list);
            return mf__rdv_fail(c, MF_ERR_TIMEOUT, untouched, "rank%s %s did not take the result "
                                "within %lld ms", mf__rdv_plural(waiting), list,
                                (long long)c->timeout_ms);
        }
        uint64_t ready = 0;
        if (mf__rdv_poll_ranks(c, waiting, POLLOUT, left, &ready) < 0)
            return mf__rdv_fail(c, MF_ERR_SYSTEM, untouched, "poll: %s", strerror(errno));
        for (int32_t r = 1; r < R; r++) {
            if (!(ready & ((uint64_t)1 << r))) continue;
            int st = mf__rdv_xfer_step(c->fd[r], &x[r], 1);
            if (st == MF__IO_CLOSED)
                return mf__rdv_fail(c, MF_ERR_SYSTEM, untouched & ~((uint64_t)1 << r), "rank %d "
                                    "closed its connection (it exited or failed)", (int)r);
            if (st == MF__IO_ERROR)
                return mf__rdv_fail(c, MF_ERR_SYSTEM, untouched & ~((uint64_t)1 << r), "send to "
                                    "rank %d: %s", (int)r, strerror(errno));
            if (st == MF__IO_DONE) waiting &= ~((uint64_t)1 << r);
        }
    }
    return MF_SUCCESS;
}

/* Ranks 1 .. R-1: sends this rank's block to rank 0 and reads the result, both at once (rank 0
 * may answer with a failure before it has read everything, e.g. when bytes differ). */
static mf_result_t mf__rdv_gather_leaf(mf__rdv_t *c, const void *send, char *recv, size_t bytes,
                                       int64_t deadline) {
    const int fd = c->fd[0];
    mf__rdv_msg_t out, in;
    mf__rdv_msg_init(&out, MF__RDV_BLOCK);
    out.rank = c->rank;
    out.sequence = c->sequence;
    out.bytes = bytes;
    mf__rdv_xfer_t tx, rx;
    mf__rdv_xfer_init(&tx, &out, sizeof out, send, bytes);
    mf__rdv_xfer_init(&rx, &in, sizeof in, NULL, 0);
    int sending = 1, head_checked = 0;

    while (!(head_checked && mf__rdv_xfer_complete(&rx))) {
        int left = mf__rdv_left_ms(deadline);
        if (left == 0)
            return mf__rdv_fail(c, MF_ERR_TIMEOUT, 0, "timed out after %lld ms %s rank 0",
                                (long long)c->timeout_ms,
                                sending ? "sending this rank's block to" : "waiting for the result from");
        struct pollfd p = {fd, (short)(POLLIN | (sending ? POLLOUT : 0)), 0};
        if (poll(&p, 1, left) < 0) {
            if (errno == EINTR) continue;
            return mf__rdv_fail(c, MF_ERR_SYSTEM, 0, "poll: %s", strerror(errno));
        }
        if (!p.revents) continue;
        /* Read first: a failure note from rank 0 explains a send that fails next. */
        for (;;) {
            int st = mf__rdv_xfer_step(fd, &rx, 0);
            if (st == MF__IO_AGAIN) break;
            if (st == MF__IO_CLOSED)
                return mf__rdv_fail(c, MF_ERR_SYSTEM, 0, "rank 0 closed its connection (it exited "
                                    "or failed)");
            if (st == MF__IO_ERROR)
                return mf__rdv_fail(c, MF_ERR_SYSTEM, 0, "recv from rank 0: %s", strerror(errno));
            if (head_checked) break; /* the whole result is in */
            if (!mf__rdv_msg_ok(&in, MF__RDV_RESULT))
                return mf__rdv_fail(c, MF_ERR_SYSTEM, 0, "protocol error: rank 0 sent no RESULT");
            if (in.status != MF_SUCCESS) {
                in.note[sizeof in.note - 1] = '\0';
                return mf__rdv_fail(c, mf__rdv_status_code(in.status), 0, "rank 0 reports: %s",
                                    in.note);
            }
            if (in.sequence != c->sequence || in.bytes != (uint64_t)bytes || sending)
                return mf__rdv_fail(c, MF_ERR_SYSTEM, 0, "protocol error: rank 0's result does not "
                                    "match this call");
            head_checked = 1;
            rx.body = recv;
            rx.body_len = (size_t)c->num_ranks * bytes;
        }
        if (sending) {
            int st = mf__rdv_xfer_step(fd, &tx, 1);
            if (st == MF__IO_DONE) sending = 0;
            else if (st == MF__IO_CLOSED) sending = 0; /* rank 0 is gone: its note or EOF follows */
            else if (st == MF__IO_ERROR)
                return mf__rdv_fail(c, MF_ERR_SYSTEM, 0, "send to rank 0: %s", strerror(errno));
        }
    }
    return MF_SUCCESS;
}

static int32_t mf__rdv_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    mf__rdv_t *c = (mf__rdv_t *)ctx;
    if (!c) return (int32_t)mf__error(MF_ERR_INVALID_ARGUMENT, "rendezvous allgather: ctx is NULL");
    if (c->failure != MF_SUCCESS)
        return (int32_t)mf__error(c->failure, "rendezvous allgather: unusable after an earlier "
                                  "failure: %s", c->error);
    if (bytes && (!send || !recv))
        return (int32_t)mf__rdv_fail(c, MF_ERR_INVALID_ARGUMENT, c->rank == 0 ? ~(uint64_t)1 : 0,
                                     "rank %d passed %s = NULL with bytes = %zu", (int)c->rank,
                                     send ? "recv" : "send", bytes);
    if (bytes > SIZE_MAX / (size_t)c->num_ranks)
        return (int32_t)mf__rdv_fail(c, MF_ERR_INVALID_ARGUMENT, c->rank == 0 ? ~(uint64_t)1 : 0,
                                     "rank %d passed bytes = %zu: R * bytes overflows", (int)c->rank,
                                     bytes);
    mf_result_t res = MF_SUCCESS;
    if (c->num_ranks == 1) {
        if (bytes) memmove(recv, send, bytes);
    } else {
        int64_t deadline = mf__rdv_now_ms() + c->timeout_ms;
        res = c->rank == 0 ? mf__rdv_gather_root(c, send, (char *)recv, bytes, deadline)
                           : mf__rdv_gather_leaf(c, send, (char *)recv, bytes, deadline);
    }
    if (res == MF_SUCCESS) c->sequence++;
    return (int32_t)res;
}

static void mf__rdv_destroy(void *ctx) {
    mf__rdv_t *c = (mf__rdv_t *)ctx;
    if (!c) return;
    for (int32_t r = 0; r < MF_MAX_RANKS; r++) mf__rdv_close(&c->fd[r]);
    mf__free(c);
}

/* ---- the public entry ------------------------------------------------------------------------- */

mf_result_t mf_rendezvous_bootstrap(const char *address, int32_t rank, int32_t num_ranks,
                                    int64_t timeout_ms, mf_bootstrap_t *bootstrap) {
    MF_REQUIRE(bootstrap != NULL, "mf_rendezvous_bootstrap: bootstrap is NULL");
    MF_REQUIRE(address != NULL, "mf_rendezvous_bootstrap: address is NULL");
    MF_REQUIRE(num_ranks >= 1 && num_ranks <= MF_MAX_RANKS,
               "mf_rendezvous_bootstrap: num_ranks %d is outside [1, MF_MAX_RANKS = %d]",
               (int)num_ranks, MF_MAX_RANKS);
    MF_REQUIRE(rank >= 0 && rank < num_ranks,
               "mf_rendezvous_bootstrap: rank %d is outside [0, num_ranks = %d)", (int)rank,
               (int)num_ranks);
    MF_REQUIRE(timeout_ms >= 0, "mf_rendezvous_bootstrap: timeout_ms %lld is negative",
               (long long)timeout_ms);
    struct sockaddr_un sa;
    socklen_t sa_len = 0;
    MF_CHECK(mf__rdv_parse(address, &sa, &sa_len));

    mf__rdv_t *c = (mf__rdv_t *)mf__calloc(1, sizeof *c);
    if (!c) return mf__error(MF_ERR_OUT_OF_MEMORY, "mf_rendezvous_bootstrap: out of memory");
    c->rank = rank;
    c->num_ranks = num_ranks;
    c->timeout_ms = timeout_ms ? timeout_ms : mf__param_timeout_ms();
    if (c->timeout_ms > MF__RDV_MAX_TIMEOUT_MS) c->timeout_ms = MF__RDV_MAX_TIMEOUT_MS;
    for (int32_t r = 0; r < MF_MAX_RANKS; r++) c->fd[r] = -1;

    if (num_ranks > 1) { /* R = 1 needs no socket */
        int64_t deadline = mf__rdv_now_ms() + c->timeout_ms;
        mf_result_t res = rank == 0 ? mf__rdv_root(c, &sa, sa_len, address, deadline)
                                    : mf__rdv_join(c, &sa, sa_len, address, deadline);
        if (res != MF_SUCCESS) {
            mf__rdv_destroy(c);
            return res;
        }
    }
    bootstrap->allgather = mf__rdv_allgather;
    bootstrap->ctx = c;
    bootstrap->destroy = mf__rdv_destroy;
    return MF_SUCCESS;
}
