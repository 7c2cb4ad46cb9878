/*
 * bench_json.c — the JSON pieces both benchmarks of the CLI write (docs/DESIGN.md "Benchmark records"):
 * escaped strings, numbers (null when not finite) and the record's meta header; the early check of
 * the --json path; and the CLI's exit with a message (tools/bench.h has the statuses).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

void cli_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

void cli_json_number(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, "%.6g", x);
    else fprintf(f, "null");
}

/* The commit of the tree: MF_COMMIT (for copies of the tree without .git, e.g. the GPU machine),
 * else git, else "unknown". */
static void git_commit(char *out, size_t n) {
    snprintf(out, n, "unknown");
    const char *env = getenv("MF_COMMIT");
    if (env && *env) {
        snprintf(out, n, "%s", env);
        return;
    }
    FILE *p = popen("git rev-parse --short HEAD 2>/dev/null", "r");
    if (!p) return;
    char buf[64];
    if (fgets(buf, sizeof buf, p)) {
        buf[strcspn(buf, "\r\n")] = '\0';
        if (buf[0]) snprintf(out, n, "%s", buf);
    }
    pclose(p);
}

void cli_json_meta(FILE *f, const char *backend, int argc, char **argv) {
    char date[32], commit[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    git_commit(commit, sizeof commit);
    const char *card = getenv("MF_CARD");
    fprintf(f, "{\"meta\": {\"card\": ");
    cli_json_string(f, !strcmp(backend, "cpu") ? "cpu" : card && *card ? card : "h200");
    fprintf(f, ", \"date\": \"%s\", \"commit\": ", date);
    cli_json_string(f, commit);
    fprintf(f, ", \"command\": \"");
    for (int i = 0; i < argc; i++) { /* argv joined by spaces; each escaped as a JSON string body */
        if (i) fputc(' ', f);
        for (const char *s = argv[i]; *s; s++) {
            unsigned char c = (unsigned char)*s;
            if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
            else if (c < 0x20) fprintf(f, "\\u%04x", c);
            else fputc(c, f);
        }
    }
    fprintf(f, "\", \"backend\": ");
    cli_json_string(f, backend);
    /* The library's knobs set for this run (MF_PDL=0 and the like; docs/API.md), so that an A/B's
     * records say which side they are; MF_COMMIT and MF_CARD are in the fields above. */
    extern char **environ;
    int n = 0;
    for (char **e = environ; e && *e; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "MF_", 3) || !eq || !strncmp(*e, "MF_COMMIT=", 10) || !strncmp(*e, "MF_CARD=", 8)) continue;
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)(eq - *e < 127 ? eq - *e : 127), *e);
        fprintf(f, "%s", n++ ? ", " : ", \"env\": {");
        cli_json_string(f, name);
        fprintf(f, ": ");
        cli_json_string(f, eq + 1);
    }
    if (n) fprintf(f, "}");
    fprintf(f, "}, \"rows\": [");
}

int cli_json_check_writable(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) { /* it did not exist: leave nothing behind until the record is written */
        close(fd);
        unlink(path);
        return 0;
    }
    if (errno != EEXIST) return -1;
    fd = open(path, O_WRONLY | O_CLOEXEC); /* it exists: writable, not truncated yet */
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

void cli_die(int status, const char *who, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", who);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(status);
}
