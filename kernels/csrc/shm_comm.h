// Shared-memory collectives of a CPU tensor-parallel group (shm_comm.cpp).
#pragma once

#include <ATen/ATen.h>  // (not torch/extension.h: its Python bindings cost each file ~20 s of compiling)

#include <string>

class ShmComm {
 public:
  // Maps the group's file (made by Python at file_bytes() size, zero-filled).
  ShmComm(const std::string& path, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  static int64_t file_bytes(int64_t world, int64_t slot_bytes);
  int64_t slot_bytes() const { return slot_bytes_; }

  void all_reduce(at::Tensor& x);                 // float32, in place, summed in rank order
  void broadcast(at::Tensor& x, int64_t src);     // any dtype, in place
  at::Tensor all_gather(const at::Tensor& x);     // [world, *x.shape]

 private:
  char* slot(int64_t buffer, int64_t rank) const;
  void arrive_and_wait();
  void check(const at::Tensor& x, int64_t bytes) const;

  int64_t rank_, world_, slot_bytes_;
  double timeout_s_;
  int64_t bytes_ = 0;
  int64_t seq_ = 0;
  char* base_ = nullptr;
};
