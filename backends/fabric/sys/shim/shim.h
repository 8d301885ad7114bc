/* kvxfer-fabric-sys: out-of-line wrappers for the `static inline` calls of libfabric's headers.
 * bindgen cannot bind inline functions; each kvx_ wrapper calls exactly the libfabric function of the
 * same name (without the prefix) and adds nothing. */
#ifndef KVX_FABRIC_SHIM_H
#define KVX_FABRIC_SHIM_H

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

struct fi_info *kvx_fi_allocinfo(void);
/* strdup with the C allocator, for fi_info string fields that fi_freeinfo frees. */
char *kvx_strdup(const char *s);
int kvx_fi_close(struct fid *fid);
int kvx_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int kvx_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int kvx_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int kvx_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int kvx_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int kvx_fi_enable(struct fid_ep *ep);
int kvx_fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int kvx_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                     void *context);
int kvx_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
int kvx_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
void *kvx_fi_mr_desc(struct fid_mr *mr);
uint64_t kvx_fi_mr_key(struct fid_mr *mr);
int kvx_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int kvx_fi_mr_enable(struct fid_mr *mr);
ssize_t kvx_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, uint64_t addr,
                     uint64_t key, void *context);
ssize_t kvx_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t kvx_fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                         fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context);
ssize_t kvx_fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, void *context);
ssize_t kvx_fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags);
ssize_t kvx_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context);
ssize_t kvx_fi_cancel(struct fid *fid, void *context);
ssize_t kvx_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t kvx_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *kvx_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);


/* The CQ's wait fd (fi_control FI_GETWAIT), or a negative fi_errno. */
int kvx_cq_wait_fd(struct fid_cq *cq);
/* fi_trywait on one CQ: 0 when it is safe to block on its wait fd. */
int kvx_fi_trywait(struct fid_fabric *fabric, struct fid_cq *cq);
/* poll(2) for POLLIN on up to two fds (fd2 < 0: ignored); returns poll's result or -errno. */
int kvx_poll_in(int fd1, int fd2, int timeout_ms);
/* A non-blocking, close-on-exec pipe; returns 0 or -errno. */
int kvx_pipe(int fds[2]);
/* Reads and discards what the fd holds (non-blocking). */
void kvx_drain(int fd);
/* Writes one byte (non-blocking; a full pipe already wakes the reader). */
void kvx_poke(int fd);
/* atexit(3). */
int kvx_atexit(void (*f)(void));
/* close(2). */
void kvx_close_fd(int fd);

#endif
