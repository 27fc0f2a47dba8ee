/* A TCP proxy that holds every byte for a one-way delay in each direction: a network round
 * trip, where the kernel has no `netem`. Built and started by tests/drivers/netns.py (DelayProxy).
 *
 *   delay_proxy LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_FILE
 *
 * DELAY_FILE holds the one-way delay in milliseconds, re-read every 0.2 s, so one running pool is
 * measured at several round trips. One thread, one epoll: what a socket delivers is stamped when
 * it arrives and queued on its direction, and one timerfd wakes the thread when the earliest
 * queued chunk is due, which it then sends, in order: bytes and order are kept exactly, and a
 * close is passed on after the data before it. A message past 0 ms costs the proxy two wake-ups
 * (its arrival, its due time), not a reader's, a writer's and a sleep's: the proxy shares the
 * cores with what it measures, where each wake-up is a cost a real network does not have.
 * C, not Python: a Python proxy's thread handoffs alone cost over a millisecond a round trip
 * here. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 262144
#define RELOAD_NS 200000000L

static long delay_ns = 0;
static const char *delay_file;

struct chunk {
    struct chunk *next;
    long due_ns;
    ssize_t len; /* 0: the peer closed */
    ssize_t off; /* bytes of it sent so far */
    char data[];
};

struct dir {
    int src, dst;
    struct chunk *head, *tail;
    int reading; /* src still read: no close seen */
    int done;    /* the close was passed on */
    int blocked; /* dst full: waiting for EPOLLOUT */
};

/* What an epoll event points at: the listener, the timer, or one socket of a connection. */
struct tag {
    int kind; /* 0 listener, 1 timer, 2 socket */
    struct conn *conn;
    int side; /* which of conn->fds */
};

struct conn {
    struct dir d[2]; /* d[0]: client -> target, d[1]: target -> client */
    int fds[2];
    int watched[2];     /* each socket in the epoll set */
    struct tag tags[2]; /* each socket's, for its epoll events */
    struct conn *next;
    int dead;
};

static int ep, timer;
static struct conn *conns;
static struct tag listener_tag = {0, NULL, 0}, timer_tag = {1, NULL, 0};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void reload_delay(void) {
    FILE *f = fopen(delay_file, "r");
    if (!f) return;
    double ms;
    if (fscanf(f, "%lf", &ms) == 1 && ms >= 0) delay_ns = (long)(ms * 1e6);
    fclose(f);
}

/* What a socket waits for: input while the direction out of it still reads, output while the
 * direction into it is blocked; nothing (out of epoll, which reports a hang-up or an error
 * unasked) once neither, so a closed socket whose other direction still drains is not reported
 * over and over. */
static void rewatch(struct conn *c, int side) {
    struct dir *out = &c->d[side], *in = &c->d[1 - side];
    struct epoll_event ev = {0};
    ev.events = (out->reading ? EPOLLIN : 0) | (in->blocked ? EPOLLOUT : 0);
    ev.data.ptr = &c->tags[side];
    if (!ev.events) {
        if (c->watched[side]) epoll_ctl(ep, EPOLL_CTL_DEL, c->fds[side], NULL);
        c->watched[side] = 0;
        return;
    }
    epoll_ctl(ep, c->watched[side] ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fds[side], &ev);
    c->watched[side] = 1;
}

static void kill_conn(struct conn *c) {
    if (c->dead) return;
    c->dead = 1;
    for (int i = 0; i < 2; i++) {
        if (c->watched[i]) epoll_ctl(ep, EPOLL_CTL_DEL, c->fds[i], NULL);
        close(c->fds[i]);
        struct chunk *k = c->d[i].head;
        while (k) {
            struct chunk *n = k->next;
            free(k);
            k = n;
        }
        c->d[i].head = c->d[i].tail = NULL;
    }
}

/* Read what src holds now into its direction's queue, stamped due. */
static void take_in(struct conn *c, int side) {
    static char buf[CHUNK];
    struct dir *d = &c->d[side];
    ssize_t n = recv(d->src, buf, CHUNK, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    struct chunk *k = malloc(sizeof(struct chunk) + (n > 0 ? n : 0));
    if (n > 0) memcpy(k->data, buf, n);
    k->len = n > 0 ? n : 0;
    k->off = 0;
    k->due_ns = now_ns() + delay_ns;
    k->next = NULL;
    if (d->tail) d->tail->next = k; else d->head = k;
    d->tail = k;
    if (n <= 0) { /* a close (or an error, passed on as one) after the data before it */
        d->reading = 0;
        rewatch(c, side);
    }
}

/* Send what is due on one direction, in order (the connection dies with a failed send). */
static void send_due(struct conn *c, int side, long now) {
    struct dir *d = &c->d[side];
    while (d->head && d->head->due_ns <= now) {
        struct chunk *k = d->head;
        if (k->len == 0) {
            shutdown(d->dst, SHUT_WR);
            d->done = 1;
        } else {
            while (k->off < k->len) {
                ssize_t w = send(d->dst, k->data + k->off, k->len - k->off,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w < 0 && errno == EINTR) continue;
                if (w < 0 && errno == EAGAIN) {
                    if (!d->blocked) {
                        d->blocked = 1;
                        rewatch(c, 1 - side); /* dst is fds[1 - side] */
                    }
                    return;
                }
                if (w <= 0) {
                    kill_conn(c);
                    return;
                }
                k->off += w;
            }
        }
        d->head = k->next;
        if (!d->head) d->tail = NULL;
        free(k);
    }
    if (d->blocked) {
        d->blocked = 0;
        rewatch(c, 1 - side);
    }
    if (c->d[0].done && c->d[1].done) kill_conn(c);
}

/* Arm the timer for the earliest queued chunk not yet sent (and the delay file's next look). */
static void arm(long now, long reload_at) {
    long next = reload_at;
    for (struct conn *c = conns; c; c = c->next) {
        for (int i = 0; i < 2; i++) {
            struct chunk *k = c->d[i].head;
            if (k && !c->d[i].blocked && k->due_ns < next) next = k->due_ns;
        }
    }
    long wait = next - now;
    if (wait < 1000) wait = 1000; /* 0 would disarm it */
    struct itimerspec its = {{0, 0}, {wait / 1000000000L, wait % 1000000000L}};
    timerfd_settime(timer, 0, &its, NULL);
}

static struct sockaddr_in addr_of(const char *host, const char *port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(port))};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        fprintf(stderr, "delay_proxy: bad IPv4 address %s\n", host);
        exit(2);
    }
    return a;
}

static void accept_one(int ls, struct sockaddr_in *target) {
    int cl = accept4(ls, NULL, NULL, SOCK_NONBLOCK);
    if (cl < 0) return;
    int up = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (connect(up, (struct sockaddr *)target, sizeof *target) != 0) {
        close(cl);
        close(up);
        return;
    }
    fcntl(up, F_SETFL, fcntl(up, F_GETFL) | O_NONBLOCK);
    setsockopt(cl, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(up, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct conn *c = calloc(1, sizeof *c);
    c->fds[0] = cl;
    c->fds[1] = up;
    for (int i = 0; i < 2; i++) {
        c->d[i].src = c->fds[i];
        c->d[i].dst = c->fds[1 - i];
        c->d[i].reading = 1;
        c->tags[i] = (struct tag){2, c, i};
    }
    rewatch(c, 0);
    rewatch(c, 1);
    c->next = conns;
    conns = c;
}

/* Dead connections off the list (freed only here: an event of this pass may still name one). */
static void reap(void) {
    struct conn **p = &conns;
    while (*p) {
        if ((*p)->dead) {
            struct conn *gone = *p;
            *p = gone->next;
            free(gone);
        } else {
            p = &(*p)->next;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_FILE\n",
                argv[0]);
        return 2;
    }
    struct sockaddr_in listen_at = addr_of(argv[1], argv[2]), target = addr_of(argv[3], argv[4]);
    delay_file = argv[5];
    reload_delay();
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, (struct sockaddr *)&listen_at, sizeof listen_at) != 0 || listen(ls, 256) != 0) {
        perror("delay_proxy: listen");
        return 1;
    }
    ep = epoll_create1(0);
    timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listener_tag};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    ev.data.ptr = &timer_tag;
    epoll_ctl(ep, EPOLL_CTL_ADD, timer, &ev);
    long reload_at = now_ns() + RELOAD_NS;
    arm(now_ns(), reload_at);
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(ep, events, 64, -1);
        if (n < 0 && errno != EINTR) {
            perror("delay_proxy: epoll_wait");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            struct tag *t = events[i].data.ptr;
            if (t->kind == 0) {
                accept_one(ls, &target);
            } else if (t->kind == 1) {
                unsigned long long expired;
                while (read(timer, &expired, sizeof expired) > 0) {}
            } else if (!t->conn->dead && t->conn->d[t->side].reading &&
                       (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
                take_in(t->conn, t->side); /* a hang-up or an error reads as the close */
            }
            /* EPOLLOUT: the blocked direction into that socket is sent below, with the rest. */
        }
        long now = now_ns();
        if (now >= reload_at) {
            reload_delay();
            reload_at = now + RELOAD_NS;
        }
        for (struct conn *c = conns; c; c = c->next) {
            for (int s = 0; s < 2 && !c->dead; s++) send_due(c, s, now);
        }
        reap();
        arm(now_ns(), reload_at);
    }
}
